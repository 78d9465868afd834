//! Whole-module tests against model fixtures in
//! `core/tests/fixtures/tokenize/`. Expected renders were produced by
//! jinja2 3.1 configured as transformers configures it.

use super::*;

const QWEN_CONFIG: &str =
    include_str!("../../tests/fixtures/tokenize/qwen2.5-instruct.tokenizer_config.json");
const LLAMA_CONFIG: &str =
    include_str!("../../tests/fixtures/tokenize/llama-3-instruct.tokenizer_config.json");
const WORDLEVEL_JSON: &str = include_str!("../../tests/fixtures/tokenize/wordlevel.tokenizer.json");

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "  What is 2+2?\n"),
        ChatMessage::new("assistant", "2+2 is 4."),
        ChatMessage::new("user", "And 3+3? Café ☕"),
    ]
}

fn render(source: &str, messages: &[ChatMessage]) -> Result<String, TokenizeError> {
    ChatTemplate::from_source(source, Some("<s>"), None)?.render(messages, false)
}

#[test]
fn qwen_template_renders_like_transformers() {
    let template = ChatTemplate::from_tokenizer_config(QWEN_CONFIG.as_bytes()).unwrap();
    let expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                    <|im_start|>user\n  What is 2+2?\n<|im_end|>\n\
                    <|im_start|>assistant\n2+2 is 4.<|im_end|>\n\
                    <|im_start|>user\nAnd 3+3? Café ☕<|im_end|>\n";
    assert_eq!(template.render(&conversation(), false).unwrap(), expected);
    assert_eq!(
        template.render(&conversation(), true).unwrap(),
        format!("{expected}<|im_start|>assistant\n")
    );
}

#[test]
fn qwen_template_adds_its_default_system_prompt() {
    let template = ChatTemplate::from_tokenizer_config(QWEN_CONFIG.as_bytes()).unwrap();
    assert_eq!(
        template
            .render(&[ChatMessage::new("user", "Hi")], true)
            .unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn llama3_template_renders_like_transformers() {
    let template = ChatTemplate::from_tokenizer_config(LLAMA_CONFIG.as_bytes()).unwrap();
    let ChatTemplate::Jinja(jinja) = &template else {
        panic!("expected a Jinja template");
    };
    assert_eq!(jinja.bos_token(), Some("<|begin_of_text|>"));
    assert_eq!(jinja.eos_token(), Some("<|eot_id|>"));
    let expected = "<|begin_of_text|>\
                    <|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>\
                    <|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>\
                    <|start_header_id|>assistant<|end_header_id|>\n\n2+2 is 4.<|eot_id|>\
                    <|start_header_id|>user<|end_header_id|>\n\nAnd 3+3? Café ☕<|eot_id|>";
    assert_eq!(template.render(&conversation(), false).unwrap(), expected);
    assert_eq!(
        template.render(&conversation(), true).unwrap(),
        format!("{expected}<|start_header_id|>assistant<|end_header_id|>\n\n")
    );
}

#[test]
fn raise_exception_becomes_an_error_with_its_message() {
    let source = "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}\
                  {{ raise_exception('Conversation roles must alternate user/assistant') }}\
                  {% endif %}{{ m.content }}{% endfor %}";
    let ok = [
        ChatMessage::new("user", "a"),
        ChatMessage::new("assistant", "b"),
    ];
    assert_eq!(render(source, &ok).unwrap(), "ab");
    let err = render(source, &[ChatMessage::new("assistant", "b")]).unwrap_err();
    assert!(matches!(err, TokenizeError::TemplateRaised(_)), "{err:?}");
    assert!(
        err.to_string()
            .contains("Conversation roles must alternate user/assistant"),
        "{err}"
    );
}

#[test]
fn template_errors_are_reported() {
    let err = ChatTemplate::from_source("{% for m in messages %}", None, None).unwrap_err();
    assert!(matches!(err, TokenizeError::InvalidTemplate(_)), "{err:?}");
    let err = render("{{ messages.nope.deeper }}", &[]).unwrap_err();
    assert!(matches!(err, TokenizeError::Render(_)), "{err:?}");
}

#[test]
fn whitespace_control_matches_transformers() {
    let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n  U: {{ m.content }}\n    \
                  {% else %}\n  A: {{ m.content }}\n    {%- endif %}\n{% endfor %}\n";
    let messages = [
        ChatMessage::new("user", "hi"),
        ChatMessage::new("assistant", "yo"),
    ];
    assert_eq!(render(source, &messages).unwrap(), "  U: hi\n  A: yo");
}

#[test]
fn undefined_is_lenient_and_tools_are_none() {
    let source = "[{{ nothing }}]{% if nothing %}x{% endif %}{% for a in nothing %}y{% endfor %}\
                  [{{ eos_token }}]{% if tools is defined and tools is none %}T{% endif %}\
                  {% if documents is none %}D{% endif %}{{ bos_token }}";
    assert_eq!(render(source, &[]).unwrap(), "[][]TD<s>");
}

#[test]
fn python_methods_loop_controls_and_tojson() {
    let messages = [
        ChatMessage::new("user", "  a<b é "),
        ChatMessage::new("assistant", "x"),
    ];
    let source = "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}\
                  {{ m.content.strip().upper() }}|{{ m.role.startswith('us') }}|{{ m | tojson }}\
                  {% endfor %}";
    assert_eq!(
        render(source, &messages).unwrap(),
        "A<B É|True|{\"role\": \"user\", \"content\": \"  a<b é \"}"
    );
    let year = render("{{ strftime_now('%Y') }}", &[]).unwrap();
    assert_eq!(year.len(), 4, "{year}");
}

#[test]
fn hugging_face_tokenizer_adds_bos_only_with_special_tokens() {
    let tokenizer = Tokenizer::from_tokenizer_json(WORDLEVEL_JSON.as_bytes()).unwrap();
    assert_eq!(tokenizer.name(), "huggingface");
    assert_eq!(
        tokenizer.encode("hello, world!", false).unwrap(),
        [2, 4, 3, 5]
    );
    assert_eq!(
        tokenizer.encode("hello, world!", true).unwrap(),
        [1, 2, 4, 3, 5]
    );
    assert_eq!(tokenizer.encode("hello there", false).unwrap(), [2, 0]);
    // An added token in the text is matched whole, whatever the flag.
    assert_eq!(tokenizer.encode("<s>hello", false).unwrap(), [1, 2]);
    assert!(format!("{tokenizer:?}").contains("HuggingFace"));
}

#[test]
fn truncation_in_tokenizer_json_is_ignored_as_transformers_does() {
    let mut json: serde_json::Value = serde_json::from_str(WORDLEVEL_JSON).unwrap();
    json["truncation"] = serde_json::json!({
        "direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0
    });
    let tokenizer = Tokenizer::from_tokenizer_json(json.to_string().as_bytes()).unwrap();
    assert_eq!(
        tokenizer.encode("hello world hello world", false).unwrap(),
        [2, 3, 2, 3]
    );
}

#[test]
fn a_text_may_be_cut_before_its_last_special_token() {
    let tokenizer = Tokenizer::from_tokenizer_json(WORDLEVEL_JSON.as_bytes()).unwrap();
    let text = "hello <s> world, <s>hello";
    let (ids, cut) = tokenizer.encode_cut(text).unwrap();
    assert_eq!(ids, tokenizer.encode(text, false).unwrap());
    let cut = cut.unwrap();
    assert_eq!((cut.tokens, cut.at), (4, 17));
    let head = tokenizer.encode(&text[..cut.at], false).unwrap();
    assert_eq!(head, ids[..cut.tokens]);
    // No special token, one only at the start, a long tail, or the
    // built-in tokenizer: no cut.
    assert_eq!(tokenizer.encode_cut("hello world").unwrap().1, None);
    assert_eq!(tokenizer.encode_cut("<s>hello world").unwrap().1, None);
    let long = format!("hello <s>{}", " world".repeat(3000));
    assert_eq!(tokenizer.encode_cut(&long).unwrap().1, None);
    assert_eq!(Tokenizer::builtin().encode_cut(text).unwrap().1, None);
    // A special token that strips the whitespace on its left does not cut.
    let mut json: serde_json::Value = serde_json::from_str(WORDLEVEL_JSON).unwrap();
    json["added_tokens"][1]["lstrip"] = serde_json::json!(true);
    let lstrip = Tokenizer::from_tokenizer_json(json.to_string().as_bytes()).unwrap();
    assert_eq!(lstrip.encode_cut(text).unwrap().1, None);
}

#[test]
fn invalid_tokenizer_json_is_a_clear_error() {
    let err = Tokenizer::from_tokenizer_json(b"{ not json").unwrap_err();
    assert!(
        matches!(err, TokenizeError::InvalidTokenizerJson(_)),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with("invalid tokenizer.json: "),
        "{err}"
    );
    let err = Tokenizer::from_tokenizer_json(br#"{"model": {"type": "Nope"}}"#).unwrap_err();
    assert!(
        matches!(err, TokenizeError::InvalidTokenizerJson(_)),
        "{err:?}"
    );
}

#[test]
fn chat_prompts_take_bos_from_the_template_only() {
    let tokenizer = Tokenizer::from_tokenizer_json(WORDLEVEL_JSON.as_bytes()).unwrap();
    let template = ChatTemplate::from_source(
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}assistant:{% endif %}",
        Some("<s>"),
        None,
    )
    .unwrap();
    let messages = vec![ChatMessage::new("user", "hello, world!")];
    assert_eq!(
        chat_prompt_tokens(&tokenizer, &template, messages).unwrap(),
        [1, 6, 8, 2, 4, 3, 5, 7, 8]
    );
    assert_eq!(
        completion_prompt_tokens(&tokenizer, "hello world").unwrap(),
        [1, 2, 3]
    );
}

#[test]
fn builtin_prompts_have_no_special_tokens() {
    let tokenizer = Tokenizer::builtin();
    let template = ChatTemplate::builtin();
    let messages = conversation();
    let rendered = template.render(&messages, true).unwrap();
    assert_eq!(
        chat_prompt_tokens(&tokenizer, &template, messages.clone()).unwrap(),
        tokenizer.encode(&rendered, false).unwrap()
    );
    assert_eq!(
        completion_prompt_tokens(&tokenizer, "Hello, world").unwrap(),
        [79479, 15371, 60414, 6590, 66410]
    );
    assert_eq!(tokenizer.name(), "builtin");
}

#[test]
fn tokenizers_and_templates_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn clone<T: Clone>() {}
    send_sync::<Tokenizer>();
    send_sync::<ChatTemplate>();
    send_sync::<TokenizeError>();
    clone::<Tokenizer>();
    clone::<ChatTemplate>();
}

#[test]
fn values_print_as_python_prints_them() {
    let source = "{{ none }}|{{ true }}|{{ 1.0 }}|{{ 10 / 4 }}|{{ 7 // 2 }}|{{ [1, 'a'] }}|\
                  {{ {'k': 'v'} }}|{{ 'x' is string }}|{{ 'ab' is iterable }}";
    assert_eq!(
        render(source, &[]).unwrap(),
        "None|True|1.0|2.5|3|[1, 'a']|{'k': 'v'}|True|True"
    );
}

mod streaming {
    use proptest::prelude::*;

    use super::*;

    fn text() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9 ,.<>|\\n\u{e9}\u{4e2d}]{0,40}"
    }

    proptest! {
        /// Streaming the built-in prompt part by part gives exactly the ids
        /// of the rendered prompt, whatever the roles and contents hold.
        #[test]
        fn streamed_tokens_equal_the_rendered_prompts(
            messages in proptest::collection::vec((text(), text()), 1..4)
        ) {
            let messages: Vec<ChatMessage> = messages
                .into_iter()
                .map(|(role, content)| ChatMessage::new(role, content))
                .collect();
            let (tokenizer, template) = (Tokenizer::builtin(), ChatTemplate::builtin());
            let mut streamed = Vec::new();
            prop_assert!(for_each_chat_token(&tokenizer, &template, &messages, true, |t| streamed.push(t)));
            // Fed a message at a time, then the generation prompt: the same.
            let mut pieces = Vec::new();
            for m in messages.chunks(1) {
                for_each_chat_token(&tokenizer, &template, m, false, |t| pieces.push(t));
            }
            for_each_chat_token(&tokenizer, &template, &[], true, |t| pieces.push(t));
            prop_assert_eq!(&pieces, &streamed);
            prop_assert_eq!(
                streamed,
                chat_prompt_tokens(&tokenizer, &template, messages).unwrap()
            );
        }
    }

    #[test]
    fn other_tokenizers_and_templates_are_not_streamed() {
        let tokenizer = Tokenizer::from_tokenizer_json(WORDLEVEL_JSON.as_bytes()).unwrap();
        let messages = [ChatMessage::new("user", "hello")];
        let mut called = false;
        assert!(!for_each_chat_token(
            &tokenizer,
            &ChatTemplate::builtin(),
            &messages,
            true,
            |_| called = true
        ));
        assert!(!called);
    }
}
