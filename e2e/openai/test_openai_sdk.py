"""End to end with the real `openai` Python SDK: two kvroute-engine-sim
processes behind a kvroute-router process, started from the release
binaries. Run by .ci/run after the Rust tests built them:

    python3 e2e/openai/test_openai_sdk.py target/debug

The router it starts has the exact response cache on (`responseCache:
{backend: embedded}`), and the `check_response_cache_*` checks read cached
answers through the SDK, streamed and not.

With `--router URL` it starts nothing and runs the same checks against the
router at URL (the system suite, `kvroute-e2e report`, does so); the cache
checks are skipped, with a line saying so, when that router's answers carry
no `x-kvroute-response-cache` header (its cache is off).

Prints one line per check and a closing `N passed, N failed` line; exits
non-zero on any failure.
"""

import os
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

import openai

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release"
PROCS = []
CACHE_HEADER = "x-kvroute-response-cache"
# Whether the router is known to have the response cache on (the one this
# script starts); against another router, a missing header skips.
CACHE_REQUIRED = False


def start(cmd):
    """Starts a binary that prints its addresses on its first stdout line."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    PROCS.append(p)
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"{cmd[0]} exited before reporting its address")
    return line


def http_addr(line):
    return line.split("http://")[1].split(",")[0].strip()


def setup(tmp):
    sims = []
    for _ in range(2):
        line = start([f"{BIN}/kvroute-engine-sim", "--listen", "127.0.0.1:0", "--cache-listen", "127.0.0.1:0",
                      "--prefill-tokens-per-s", "0", "--prefill-overhead-ms", "0", "--itl-ms", "5"])
        http = http_addr(line)
        cache_port = line.rsplit(":", 1)[1].strip()
        sims.append((http, cache_port))
    endpoints = os.path.join(tmp, "endpoints.yaml")
    with open(endpoints, "w") as f:
        f.write("endpoints:\n")
        for i, (http, cache_port) in enumerate(sims):
            f.write(f"  - {{name: sim-{i}, address: {http}, cachePort: {cache_port}}}\n")
    config = os.path.join(tmp, "router.yaml")
    with open(config, "w") as f:
        f.write("responseCache: {backend: embedded}\n")
    line = start([f"{BIN}/kvroute-router", "--config", config, "--listen", "127.0.0.1:0",
                  "--admin-listen", "127.0.0.1:0", "--endpoints", endpoints])
    router = http_addr(line)
    client = openai.OpenAI(base_url=f"http://{router}/v1", api_key="unused", max_retries=0)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            if client.models.list().data:
                break
        except openai.APIError:
            pass
        time.sleep(0.1)
    return client


SYSTEM = " ".join(f"Rule {i}: route each request to the replica that holds its prefix." for i in range(60))


def check_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["kvroute-sim"], ids


def check_chat(client):
    r = client.chat.completions.create(
        model="kvroute-sim", max_tokens=4,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}])
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage.completion_tokens == 4
    assert r.choices[0].finish_reason == "length"


def check_chat_stream_with_usage_and_cache(client):
    def ask(question):
        stream = client.chat.completions.create(
            model="kvroute-sim", max_tokens=3, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        text, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if chunk.usage:
                usage = chunk.usage
        assert text and usage is not None
        return usage

    ask("first")
    # The engine's blocks reach the router over WatchCache within moments;
    # from then on the prefix is routed to its holder.
    deadline = time.time() + 10
    while True:
        usage = ask("again")
        cached = usage.prompt_tokens_details.cached_tokens
        if cached > usage.prompt_tokens * 0.8:
            return
        assert time.time() < deadline, (cached, usage.prompt_tokens)
        time.sleep(0.1)


def check_completions(client):
    r = client.completions.create(model="kvroute-sim", prompt="Once upon a time", max_tokens=5)
    assert r.choices[0].text
    assert r.usage.completion_tokens == 5


def check_errors(client):
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    except openai.NotFoundError as e:
        assert "no-such-model" in str(e), e
    else:
        raise AssertionError("an unknown model must be a 404")
    try:
        client.chat.completions.create(model="kvroute-sim", messages=[])
    except openai.BadRequestError:
        pass
    else:
        raise AssertionError("empty messages must be a 400")


class Skipped(Exception):
    """A check that cannot run against this router."""


def cache_result(raw):
    """The response cache's verdict on a raw response; skips when the
    router sends none (its cache is off) unless the cache must be on."""
    result = raw.headers.get(CACHE_HEADER)
    if result is None:
        if CACHE_REQUIRED:
            raise AssertionError(f"no {CACHE_HEADER} header: the response cache is off")
        raise Skipped(f"the router's answers carry no {CACHE_HEADER} header: its response cache is off")
    return result


def read_stream(raw, chat):
    """A streamed response's text, its finish reason, its usage (None when
    it sent none), its chunks' ids and whether a chunk named the role."""
    text, finish, usage, ids, role = "", None, None, set(), False
    for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.usage:
            assert usage is None, "two usage chunks"
            usage = chunk.usage
        for choice in chunk.choices:
            assert finish is None, f"a chunk after the finish reason: {chunk}"
            if chat:
                text += choice.delta.content or ""
                role = role or choice.delta.role == "assistant"
            else:
                text += choice.text or ""
            finish = choice.finish_reason
    return text, finish, usage, ids, role


def assert_hit_usage(usage, first):
    """A hit's usage: the stored answer's counts, every prompt token
    cached."""
    assert usage.prompt_tokens == first.prompt_tokens, (usage, first)
    assert usage.completion_tokens == first.completion_tokens, (usage, first)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens, usage


def check_response_cache_chat(client):
    # A question no earlier run asked, so the first answer is the engine's.
    nonce = uuid.uuid4().hex
    ask = dict(model="kvroute-sim", temperature=0, max_tokens=6,
               messages=[{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": f"What does {nonce} mean?"}])
    first_raw = client.chat.completions.with_raw_response.create(**ask)
    first = first_raw.parse()
    again_raw = client.chat.completions.with_raw_response.create(**ask)
    assert cache_result(again_raw) == "hit", again_raw.headers
    assert cache_result(first_raw) == "miss", first_raw.headers
    again = again_raw.parse()
    assert again.object == "chat.completion"
    assert again.choices[0].message.role == "assistant"
    assert again.choices[0].message.content, again
    assert again.choices[0].message.content == first.choices[0].message.content, (again, first)
    assert again.choices[0].finish_reason == first.choices[0].finish_reason, (again, first)
    assert again.model == first.model
    assert again.id != first.id and again.id.startswith("chatcmpl-"), (again.id, first.id)
    assert again.created >= first.created
    assert again_raw.headers.get("age", "").isdigit(), again_raw.headers
    assert_hit_usage(again.usage, first.usage)

    for include_usage in [False, True]:
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        raw = client.chat.completions.with_raw_response.create(**ask, stream=True, **extra)
        assert cache_result(raw) == "hit", raw.headers
        assert raw.headers["content-type"].startswith("text/event-stream"), raw.headers
        text, finish, usage, ids, role = read_stream(raw, chat=True)
        assert role, "no chunk named the assistant's role"
        assert text == first.choices[0].message.content, (text, first)
        assert finish == first.choices[0].finish_reason, (finish, first)
        assert len(ids) == 1 and first.id not in ids and again.id not in ids, ids
        if include_usage:
            assert usage is not None, "include_usage asked for a usage chunk"
            assert_hit_usage(usage, first.usage)
        else:
            assert usage is None, f"usage not asked for: {usage}"


def check_response_cache_completions(client):
    nonce = uuid.uuid4().hex
    ask = dict(model="kvroute-sim", temperature=0, max_tokens=5, prompt=f"The word {nonce} means")
    # Streamed first, without usage: the router asks the engine for it (to
    # store the answer whole) and keeps it from the client.
    raw = client.completions.with_raw_response.create(**ask, stream=True)
    result = cache_result(raw)
    text, finish, usage, _, _ = read_stream(raw, chat=False)
    assert result == "miss", raw.headers
    assert text and finish, (text, finish)
    assert usage is None, f"usage not asked for: {usage}"

    again_raw = client.completions.with_raw_response.create(**ask)
    assert cache_result(again_raw) == "hit", again_raw.headers
    again = again_raw.parse()
    assert again.object == "text_completion"
    assert again.choices[0].text == text, (again, text)
    assert again.choices[0].finish_reason == finish, (again, finish)
    assert again.id.startswith("cmpl-"), again.id
    assert again.usage.completion_tokens == 5, again.usage
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens, again.usage

    seen = {again.id}
    for include_usage in [False, True]:
        extra = {"stream_options": {"include_usage": True}} if include_usage else {}
        raw = client.completions.with_raw_response.create(**ask, stream=True, **extra)
        assert cache_result(raw) == "hit", raw.headers
        hit_text, hit_finish, usage, ids, _ = read_stream(raw, chat=False)
        assert hit_text == text, (hit_text, text)
        assert hit_finish == finish, (hit_finish, finish)
        assert len(ids) == 1 and not ids & seen, (ids, seen)
        seen |= ids
        if include_usage:
            assert usage is not None, "include_usage asked for a usage chunk"
            assert_hit_usage(usage, again.usage)
        else:
            assert usage is None, f"usage not asked for: {usage}"


def run_checks(client):
    passed = failed = 0
    for check in [check_models, check_chat, check_chat_stream_with_usage_and_cache, check_completions, check_errors,
                  check_response_cache_chat, check_response_cache_completions]:
        try:
            check(client)
            print(f"ok   {check.__name__}")
            passed += 1
        except Skipped as e:
            print(f"skip {check.__name__}: {e}")
        except Exception:
            print(f"FAIL {check.__name__}")
            traceback.print_exc()
            failed += 1
    return passed, failed


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--router":
        client = openai.OpenAI(base_url=f"{sys.argv[2]}/v1", api_key="unused", max_retries=0, timeout=30)
        passed, failed = run_checks(client)
        print(f"openai-e2e: {passed} passed, {failed} failed")
        sys.exit(1 if failed or not passed else 0)
    global CACHE_REQUIRED
    CACHE_REQUIRED = True
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            client = setup(tmp)
            passed, failed = run_checks(client)
        finally:
            for p in PROCS:
                p.terminate()
            for p in PROCS:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
    print(f"openai-e2e: {passed} passed, {failed} failed")
    sys.exit(1 if failed or not passed else 0)


if __name__ == "__main__":
    main()
