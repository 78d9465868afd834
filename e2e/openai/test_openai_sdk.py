"""End to end with the real `openai` Python SDK: two kvroute-engine-sim
processes behind a kvroute-router process, started from the release
binaries. Run by .ci/run after the Rust tests built them:

    python3 e2e/openai/test_openai_sdk.py target/debug

With `--router URL` it starts nothing and runs the same checks against the
router at URL (the system suite, `kvroute-e2e report`, does so).

Prints one line per check and a closing `N passed, N failed` line; exits
non-zero on any failure.
"""

import os
import subprocess
import sys
import tempfile
import time
import traceback

import openai

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release"
PROCS = []


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
    line = start([f"{BIN}/kvroute-router", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                  "--endpoints", endpoints])
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


def run_checks(client):
    passed = failed = 0
    for check in [check_models, check_chat, check_chat_stream_with_usage_and_cache, check_completions, check_errors]:
        try:
            check(client)
            print(f"ok   {check.__name__}")
            passed += 1
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
