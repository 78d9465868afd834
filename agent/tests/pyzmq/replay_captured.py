"""The agent against bytes kvroute did not produce: a pyzmq PUB and ROUTER
replay the KV event frames captured from vLLM 0.33.0 (the project's copy of
the vLLM vectors) to the `kvroute-agent` binary, with a live gap that the
replay socket fills exactly as vLLM's does.

    pip install pyzmq
    python3 agent/tests/pyzmq/replay_captured.py target/debug

Checks, from the agent's own /metrics: both batches applied in order, the
gap replayed and filled, request B's block verified against vLLM's hash
(sha256_cbor, no PYTHONHASHSEED, block size 4), nothing malformed.
"""

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeVllm(http.server.BaseHTTPRequestHandler):
    """vLLM's /health and the /metrics the agent reads its capacity from."""

    def do_GET(self):
        body = b""
        if self.path == "/metrics":
            body = b'vllm:cache_config_info{block_size="4",num_gpu_blocks="4"} 1.0\n'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def metric(text, family, label=""):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(family) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait(what, check, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"never: {what}")


def main():
    bins = sys.argv[1] if len(sys.argv) > 1 else "target/debug"
    with open(os.path.join(ROOT, "core/tests/fixtures/vllm_vectors.json")) as f:
        sample = json.load(f)["kv_event_sample_vllm_0_33_0"]
    topic = sample["frame0_topic"].encode()
    first = bytes.fromhex(sample["frame2_payload_hex"])
    second = bytes.fromhex(sample["second_batch"]["payload_hex"])
    end = [bytes.fromhex(h) for h in sample["replay_DEALER_frames_hex"][1]]

    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay = ctx.socket(zmq.ROUTER)
    replay_port = replay.bind_to_random_port("tcp://127.0.0.1")
    # What the publisher has sent, for replay: seq -> payload.
    buffer = {0: first, 1: second, 2: first}
    replay_requests = []

    stop = threading.Event()

    def serve_replay():
        # The socket belongs to this thread until `stop`; ZMQ sockets are
        # not thread-safe.
        while not stop.is_set():
            if not replay.poll(100):
                continue
            client, empty, start = replay.recv_multipart()
            start = int.from_bytes(start, "big")
            replay_requests.append(start)
            for seq in sorted(buffer):
                if seq >= start:
                    replay.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), buffer[seq]])
            replay.send_multipart([client] + end)

    replayer = threading.Thread(target=serve_replay)
    replayer.start()

    admin = free_port()
    agent = subprocess.Popen(
        [
            os.path.join(bins, "kvroute-agent"),
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
            "--engine-url", f"http://127.0.0.1:{http_server.server_address[1]}",
            "--listen", f"127.0.0.1:{free_port()}",
            "--admin-listen", f"127.0.0.1:{admin}",
            "--block-size", "4",
            "--prefix-caching-hash-algo", "sha256_cbor",
            "--quiet-period-ms", "200",
            "--log-format", "text",
        ],
        env={k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"},
    )
    try:
        base = f"http://127.0.0.1:{admin}"
        wait("the agent is ready", lambda: get(base + "/readyz")[0] == 200)
        metrics = lambda: get(base + "/metrics")[1]

        # Batch 0 live. Ready means subscribed a quiet period ago, so the
        # subscription has reached the publisher (PUB drops what it sends
        # before that).
        pub.send_multipart([topic, (0).to_bytes(8, "big"), first])
        wait("batch 0 is applied", lambda: metric(metrics(), "kvroute_agent_batches_total") >= 1)
        text = metrics()
        # Request A stored and evicted, B stored, then reset_prefix_cache.
        assert metric(text, "kvroute_agent_events_total", 'kind="stored"') == 2, text
        assert metric(text, "kvroute_agent_events_total", 'kind="cleared"') == 1, text
        assert metric(text, "kvroute_agent_resident_blocks") == 0, text

        # Batch 1 never goes out live: batch 2 reveals the gap, replay fills it.
        pub.send_multipart([topic, (2).to_bytes(8, "big"), first])
        wait("the gap is replayed", lambda: metric(metrics(), "kvroute_agent_replays_total", "filled") >= 1)
        text = metrics()
        assert replay_requests == [1], replay_requests
        assert metric(text, "kvroute_agent_replays_total", "unfillable") == 0, text
        assert metric(text, "kvroute_agent_restarts_total") == 0, text
        assert metric(text, "kvroute_agent_batches_total") == 3, text
        assert metric(text, "kvroute_agent_events_total", 'kind="stored"') == 4, text
        assert metric(text, "kvroute_agent_events_total", 'kind="cleared"') == 3, text
        assert metric(text, "kvroute_agent_hash_verification_blocks_total", '"match"') == 2, text
        assert metric(text, "kvroute_agent_hash_verification_blocks_total", "mismatch") == 0, text
        assert metric(text, "kvroute_agent_malformed_total") == 0, text

        # A frame that is not vLLM's is counted and skipped.
        pub.send_multipart([topic, b"\x00\x01", first])
        wait("the bad frame is counted", lambda: metric(metrics(), "kvroute_agent_malformed_total", "sequence") == 1)
        assert get(base + "/healthz")[0] == 200
        print("pyzmq replay of the captured vLLM frames: ok")
    finally:
        agent.terminate()
        agent.wait(timeout=10)
        stop.set()
        replayer.join()
        pub.close(linger=0)
        replay.close(linger=0)
        ctx.term()
        http_server.shutdown()


if __name__ == "__main__":
    main()
