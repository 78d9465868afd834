"""End to end for the endpoint picker with Envoy's own protos: two
kvroute-engine-sim processes and a kvroute-router process running as an
ext_proc picker alone (`--ext-proc-listen`, no API port), driven by a Python
gRPC client playing Envoy, built on `xds-protos` (Envoy's published Python
stubs) and `grpcio-health-checking`. Run by .ci/run:

    pip install grpcio==1.85.3 xds-protos==1.85.0 grpcio-health-checking==1.85.1
    python3 e2e/extproc/test_picker.py target/debug

Prints one line per check and a closing `N passed, N failed` line; exits
non-zero on any failure.
"""

import json
import os
import queue
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release"
PROCS = []


def start(cmd, lines=1):
    """Starts a binary; returns its first `lines` stdout lines."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    PROCS.append(p)
    out = [p.stdout.readline() for _ in range(lines)]
    if not all(out):
        raise RuntimeError(f"{cmd[0]} exited before reporting its addresses")
    return out


def setup(tmp):
    sims = []
    for _ in range(2):
        line = start([f"{BIN}/kvroute-engine-sim", "--listen", "127.0.0.1:0", "--cache-listen", "127.0.0.1:0",
                      "--prefill-tokens-per-s", "0", "--prefill-overhead-ms", "0"])[0]
        sims.append(line.split("http://")[1].split(",")[0].strip())
    endpoints = os.path.join(tmp, "endpoints.yaml")
    with open(endpoints, "w") as f:
        f.write("endpoints:\n")
        for i, http in enumerate(sims):
            f.write(f"  - {{name: sim-{i}, address: {http}}}\n")
    # Picker alone: no --listen, so no API port.
    picker_line, admin_line = start([f"{BIN}/kvroute-router", "--ext-proc-listen", "127.0.0.1:0",
                                     "--admin-listen", "127.0.0.1:0", "--endpoints", endpoints], lines=2)
    assert "endpoint picker" in picker_line, picker_line
    picker = picker_line.rsplit(" ", 1)[1].strip()
    admin = admin_line.split("http://")[1].strip()
    channel = grpc.insecure_channel(picker)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.time() + 15
    while True:
        try:
            r = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
            if r.status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        if time.time() > deadline:
            raise RuntimeError("the picker never became ready")
        time.sleep(0.1)
    return channel, sims, admin


def headers(pairs):
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


class Exchange:
    """One Process stream: requests go in through a queue, answers are read
    one at a time."""

    def __init__(self, channel):
        self.requests = queue.Queue()
        stub = ep_grpc.ExternalProcessorStub(channel)
        self.answers = stub.Process(iter(self.requests.get, None), timeout=30)

    def send(self, **kwargs):
        self.requests.put(ep.ProcessingRequest(**kwargs))

    def next(self):
        return next(self.answers)

    def close(self):
        self.requests.put(None)


def chat_body(text):
    return json.dumps({"model": "kvroute-sim", "max_tokens": 2,
                       "messages": [{"role": "system", "content": text}, {"role": "user", "content": "héllo ✓"}]
                       }).encode()


def send_request(x, body, chunk):
    x.send(request_headers=ep.HttpHeaders(
        headers=headers([(":method", "POST"), (":path", "/v1/chat/completions"),
                         ("content-type", "application/json")])))
    for i in range(0, len(body), chunk):
        x.send(request_body=ep.HttpBody(body=body[i:i + chunk], end_of_stream=i + chunk >= len(body)))


def check_a_full_exchange(channel, sims, admin):
    body = chat_body(" ".join(f"Rule {i}: route by prefix." for i in range(200)))
    x = Exchange(channel)
    send_request(x, body, 7)  # splits the UTF-8 sequences and JSON strings
    first = x.next()
    assert first.WhichOneof("response") == "request_headers", first
    common = first.request_headers.response
    assert common.clear_route_cache
    set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    picked = set_headers["x-gateway-destination-endpoint"].split(",")
    assert sorted(picked) == sorted(sims), (picked, sims)
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == ",".join(picked)
    assert set_headers["content-length"] == str(len(body))
    back = b""
    ended = False
    while not ended:
        a = x.next()
        assert a.WhichOneof("response") == "request_body", a
        streamed = a.request_body.response.body_mutation.streamed_response
        back += streamed.body
        ended = streamed.end_of_stream
    assert back == body, "the body comes back byte for byte"

    served = struct_pb2.Struct()
    served.fields["x-gateway-destination-endpoint-served"].string_value = picked[0]
    x.send(response_headers=ep.HttpHeaders(headers=headers([(":status", "200"),
                                                            ("content-type", "text/event-stream")])),
           metadata_context=base_pb2.Metadata(filter_metadata={"envoy.lb": served}))
    assert x.next().WhichOneof("response") == "response_headers"
    events = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n', b"data: [DONE]\n\n"]
    for i, event in enumerate(events):
        x.send(response_body=ep.HttpBody(body=event, end_of_stream=i == len(events) - 1))
        a = x.next()
        assert a.response_body.response.body_mutation.streamed_response.body == event
    x.close()
    metrics = urllib.request.urlopen(f"http://{admin}/metrics").read().decode()
    assert 'kvroute_requests_total{model="kvroute-sim",status="200"} 1' in metrics, metrics[:2000]


def check_an_unreadable_body_is_400(channel, sims, admin):
    x = Exchange(channel)
    send_request(x, b'{"model": ', 4)
    a = x.next()
    assert a.WhichOneof("response") == "immediate_response", a
    assert a.immediate_response.status.code == 400
    error = json.loads(a.immediate_response.body)
    assert error["error"]["type"] == "invalid_request_error", error
    x.close()


def check_a_subset_naming_no_endpoint_is_503(channel, sims, admin):
    x = Exchange(channel)
    hint = struct_pb2.Struct()
    hint.fields["x-gateway-destination-endpoint-subset"].list_value.values.add().string_value = "10.9.9.9:8000"
    x.send(request_headers=ep.HttpHeaders(headers=headers([(":method", "POST"), (":path", "/v1/chat/completions")])),
           metadata_context=base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": hint}))
    x.send(request_body=ep.HttpBody(body=chat_body("s"), end_of_stream=True))
    a = x.next()
    assert a.immediate_response.status.code == 503, a
    retry = {h.header.key: h.header.raw_value.decode() for h in a.immediate_response.headers.set_headers}
    assert retry["retry-after"] == "1", retry
    x.close()


def main():
    passed = failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        try:
            channel, sims, admin = setup(tmp)
            for check in [check_a_full_exchange, check_an_unreadable_body_is_400,
                          check_a_subset_naming_no_endpoint_is_503]:
                try:
                    check(channel, sims, admin)
                    print(f"ok   {check.__name__}")
                    passed += 1
                except Exception:  # noqa: BLE001 - report every failing check
                    print(f"FAIL {check.__name__}")
                    traceback.print_exc()
                    failed += 1
        finally:
            for p in PROCS:
                p.terminate()
            for p in PROCS:
                p.wait(timeout=10)
    print(f"picker-e2e: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
