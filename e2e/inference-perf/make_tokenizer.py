#!/usr/bin/env python3
"""Build a tiny, fully offline Hugging Face tokenizer for inference-perf.

WordLevel model over a fixed list of lowercase English words, a Whitespace
pre-tokenizer, and no normalizer/post-processor: every word is exactly one
token, decode() joins tokens with single spaces, so decode(a + b) ==
decode(a) + " " + decode(b) and the text re-encodes to the same ids.
That keeps inference-perf's exact-length prompt generation trivially
convergent and makes each shared_prefix group's system prompt a byte-exact
(and token-exact) prefix of every prompt in the group.

Writes tokenizer.json and tokenizer_config.json next to this script (or into
the directory given as argv[1]). Needs only the `tokenizers` package.
"""
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))

WORDS = """
the of and to in is was for on are with as be at by this had not but from or have an they which one you
were her all she there would their we him been has when who will more no if out so said what up its about
into than them can only other new some could time these two may then do first any my now such like our
over man me even most made after also did many before must through back years where much your way well
down should because each just those people how too little state good very make world still own see men
work long get here between both life being under never day same another know while last might us great
old year off come since against go came right used take three states himself few house use during without
again place american around however home small found thought went say part once general high upon school
every does got united left number course war until always away something fact though water less public put
think almost hand enough far took head yet government system better set told nothing night end why called
didn find look asked later knew point next program city business give group toward young days let room
president side social given present several order national possible rather second face per among form
important often things looked early white case john become large big need four within felt children along
saw best church ever least power development light thing seemed family interest want members mind country
area others done turned although open god service certain kind problem began different door thus help
means sense whole matter perhaps itself york times law human line above name example action company hands
local show whether five history gave today either act feet across taken past quite anything seen having
death week experience body word half really field am car words already themselves information tell together
""".split()

SPECIAL = ["[UNK]", "<|endoftext|>"]


def main() -> None:
    vocab = {}
    for w in SPECIAL + WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordLevel decoding = tokens joined by " "; no decoder needed (a
    # decoders.WordPiece/Metaspace would alter spacing).
    tok.add_special_tokens(SPECIAL)
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"), pretty=False)

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "unk_token": "[UNK]",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        # ChatML, so api.type=chat and a server-side --tokenizer-config both work.
        "chat_template": (
            "{% for message in messages %}"
            "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
            "{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        ),
    }
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"wrote {OUT}/tokenizer.json ({len(vocab)} tokens) and tokenizer_config.json")


if __name__ == "__main__":
    main()
