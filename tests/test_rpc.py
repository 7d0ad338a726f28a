"""Our ops on llama.cpp's RPC backend: two ggml-rpc-server processes on this machine serve every layer of the
default model (llama-completion --rpc A,B -ngl 99), and SparQ and the centroid-sparse ops run on them as they do
in one process. Also the handshake: this build's RPC protocol has a major version of its own (our ops shift enum
ggml_op), so a stock llama.cpp peer is refused instead of being sent op numbers it reads as other ops."""
from __future__ import annotations

import re
import socket
import struct
import subprocess
import threading
import time

import pytest
from conftest import free_port, run
from sparq_llama.tools import tool_path

try:
    RPC_SERVER = tool_path("ggml-rpc-server")
except FileNotFoundError as e:
    pytest.skip(f"ggml-rpc-server is not built: {e}", allow_module_level=True)

# upstream llama.cpp's protocol at the pin is 7.0.0; ours is (0xA0 | 7).0.0 (vendor/patches/0013, 0014, 0015)
STOCK_MAJOR, OUR_MAJOR = 7, 0xA0 | 7
RPC_CMD_HELLO = 14
CONN_CAPS = 24  # bytes of conn_caps in the HELLO request and reply

# 205 tokens: the first decode step already sees more cells than k2 = 128, so SparQ selects at every step
PROMPT = (
    "The history of the city began in the early middle ages, when a small settlement of farmers and traders grew "
    "up along the river. Over the following centuries the town expanded, building walls, churches and a market "
    "square that attracted merchants from distant regions. By the fifteenth century it had become an important "
    "center of commerce, known for its wool and its bridges. Wars and plagues slowed its growth, but the town "
    "survived. In 1620 a great fire destroyed most of the wooden houses near the harbour, and the council ordered "
    "that all new buildings be made of stone. The stone houses still stand today, and visitors come from far away "
    "to see the old streets, the guild halls and the cathedral with its tall spire. The university, founded in "
    "1702, brought scholars and students, and the city became known for its printers, its botanists and its music. "
    "In the nineteenth century the railway arrived, factories were built on the eastern bank, and the population "
    "tripled within fifty years. Today the city is")
N_CTX = 512
GEN = ["-no-cnv", "--temp", "0", "-t", "1", "--no-warmup"]
SPARQ = ["--sparq", "--sparq-min-kv", "0"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two ggml-rpc-server processes (one CPU thread each) on free local ports; the --rpc value. Stopped after
    the module's tests, whatever happened."""
    logs = tmp_path_factory.mktemp("rpc")
    procs, endpoints = [], []
    try:
        for i in range(2):
            port = free_port()
            with open(logs / f"server{i}.log", "w") as log:
                procs.append(subprocess.Popen([str(RPC_SERVER), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                              stdout=log, stderr=subprocess.STDOUT))
            endpoints.append(f"127.0.0.1:{port}")
        deadline = time.time() + 30
        for i, (proc, ep) in enumerate(zip(procs, endpoints)):
            while not _listening(ep):
                assert proc.poll() is None, f"ggml-rpc-server exited: {(logs / f'server{i}.log').read_text()[-2000:]}"
                assert time.time() < deadline, f"ggml-rpc-server on {ep} did not listen within 30 s"
                time.sleep(0.1)
        yield ",".join(endpoints)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _listening(endpoint: str) -> bool:
    host, port = endpoint.split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def completion(model, *args: str, n_ctx: int = N_CTX, env: dict | None = None) -> tuple[str, str]:
    res = run(["llama-completion", "-m", str(model), "-c", str(n_ctx), *GEN, *args], env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout, res.stderr


def rpc_args(servers: str) -> list[str]:
    return ["--rpc", servers, "-ngl", "99"]


def backends_of(log: str, op: str) -> list[str]:
    """The backend the scheduler gave each `op` node (GGML_SCHED_DEBUG=2 with -v prints a line per node, the op's
    name cut to 10 characters and the backend's to 5: "RPC0[" for an RPC device)."""
    return re.findall(rf"\({re.escape(op[:10])}\):\s+\S+ \(\s*[\d.]+ ?\w?\) \[(.{{5}})", log)


def assert_layers_on_rpc(log: str) -> None:
    placed = re.findall(r"load_tensors: layer\s+\d+ assigned to device (\S+?),", log)
    assert placed and all(d.startswith("RPC") for d in placed), f"layers not all on RPC devices: {placed}"
    assert {d for d in placed} == {"RPC0", "RPC1"}, f"the layers should span both servers: {sorted(set(placed))}"


def test_server_speaks_our_protocol(servers):
    """A HELLO to our server answers (0xA0 | 7).0.0: a stock llama.cpp client (major 7) refuses it."""
    host, port = servers.split(",")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(bytes([RPC_CMD_HELLO]) + struct.pack("<Q", CONN_CAPS) + bytes(CONN_CAPS))
        size = struct.unpack("<Q", _recv(s, 8))[0]
        reply = _recv(s, size)
    assert size == 4 + CONN_CAPS
    assert tuple(reply[:3]) == (OUR_MAJOR, 0, 0)


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        assert chunk, "connection closed"
        buf += chunk
    return buf


def test_stock_server_is_refused(smollm2_path):
    """A server that answers HELLO as upstream's (7.0.0) would read our op numbers as other ops: refused."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    lst.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = lst.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(10)
                try:
                    head = _recv(conn, 9)
                    _recv(conn, struct.unpack("<Q", head[1:])[0])
                    reply = bytes([STOCK_MAJOR, 0, 0, 0]) + bytes(CONN_CAPS)
                    conn.sendall(struct.pack("<Q", len(reply)) + reply)
                except (OSError, AssertionError):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        port = lst.getsockname()[1]
        res = run(["llama-completion", "-m", str(smollm2_path), "-p", "Hello", "-n", "2", *GEN,
                   "--rpc", f"127.0.0.1:{port}", "-ngl", "99"], timeout=120)
    finally:
        stop.set()
        thread.join(timeout=5)
        lst.close()
    assert res.returncode != 0
    assert f"RPC server version mismatch: {STOCK_MAJOR}.0.0, this client speaks {OUR_MAJOR}.0.0" in res.stderr, \
        res.stderr[-2000:]


def test_sparq_over_rpc(smollm2_path, servers):
    """Greedy text over RPC, 16 tokens: SparQ with k2 covering the context is dense attention's, and SparQ at
    k2 = 128 (selecting from 205..220 cells at every decode step) is the single-process SparQ run's, its nodes
    placed on the RPC devices. (16: the 20th token of this continuation is a near tie that the two exact paths'
    rounding decides differently, flash attention's f16 V sums against SparQ's f32 ones, in one process too.)"""
    gen = ["-p", PROMPT, "-n", "16"]
    dense, _ = completion(smollm2_path, *gen, *rpc_args(servers), "-v")
    full, _ = completion(smollm2_path, *gen, *rpc_args(servers), *SPARQ, "--k2", str(N_CTX))
    remote, log = completion(smollm2_path, *gen, *rpc_args(servers), *SPARQ, "--k2", "128", "-v",
                             env={"GGML_SCHED_DEBUG": "2"})
    local, _ = completion(smollm2_path, *gen, *SPARQ, "--k2", "128")

    assert_layers_on_rpc(log)
    n_prompt = re.search(r"prompt eval time =.*/\s*(\d+) tokens", log)
    assert n_prompt and int(n_prompt.group(1)) > 128, "the prompt must fill more than k2 cells"
    assert "SparQ on: k1 = 0 (head_dim/2), k2 = 128" in log, log[-2000:]
    assert "SparQ: dense attention for layer" not in log
    for op in ("SPARQ_ATTN", "SPARQ_VSUM_ROWS"):  # the attention and the running sums --sparq-select qsigma reads
        placed = backends_of(log, op)
        assert len(placed) >= 30 and all(b.startswith("RPC") for b in placed), \
            f"{op} nodes on {sorted(set(placed))} ({len(placed)} nodes)"
    for text in (dense, full, remote, local):
        assert text.startswith(PROMPT), text[:300]
    assert full == dense, f"SparQ k2 = n_ctx over RPC:\n{full[len(PROMPT):]!r}\ndense over RPC:\n{dense[len(PROMPT):]!r}"
    assert remote == local, f"SparQ k2 = 128 over RPC:\n{remote[len(PROMPT):]!r}\nin one process:\n{local[len(PROMPT):]!r}"
    # not vacuous: selecting 128 cells moves the continuation away from dense attention's
    assert remote != dense, "SparQ k2 = 128 generated dense attention's text: did it select at all?"


def test_squeeze_over_rpc(smollm2_path, servers, tmp_path):
    """Centroid-sparse attention over a prefix whose cache is on the RPC devices (k-means runs on the backend that
    holds each layer's cache, here an RPC one): the same greedy answer as in one process, the centroid nodes placed
    on the RPC devices."""
    from sparq_llama import texts

    play = texts.read(texts.names()[0])
    doc = tmp_path / "doc.txt"
    doc.write_text(play[:1200] + "\n\nThe secret number of Alice is 48213.\n\n" + play[1200:1800])
    question = "\nQuestion: What is the secret number of Alice?\nAnswer: The secret number of Alice is"
    args = ["-p", question, "-n", "8", "--squeeze", "--squeeze-prefix-file", str(doc)]
    remote, log = completion(smollm2_path, *args, *rpc_args(servers), "-v", n_ctx=1024, env={"GGML_SCHED_DEBUG": "2"})
    local, local_log = completion(smollm2_path, *args, n_ctx=1024)

    assert_layers_on_rpc(log)
    prepared = re.compile(r"prepared the fixed prefix in .* s \((keep \S+)\)")
    got, want = prepared.search(log), prepared.search(local_log)
    assert got and want, (log[-2000:], local_log[-2000:])
    assert got.group(1) == want.group(1)
    placed = backends_of(log, "CENTROID_ATTN")
    assert len(placed) >= 30 and all(b.startswith("RPC") for b in placed), \
        f"CENTROID_ATTN nodes on {sorted(set(placed))} ({len(placed)} nodes)"
    assert remote == local, f"over RPC:\n{remote[-300:]!r}\nin one process:\n{local[-300:]!r}"
    assert "48213" in remote.split("Answer: The secret number of Alice is", 1)[1]
