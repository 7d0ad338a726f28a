#!/usr/bin/env python3
"""Soak test of llama-server: many concurrent requests against 4 slots, dense vs SparQ vs a squeezed prefix.

Per configuration one llama-server on 127.0.0.1 (SmolLM2 by default, 4 slots of `--n-ctx` cells), then `--requests`
completions from `--clients` threads at once: prompts of mixed lengths (a few lines to most of a slot's context)
cut from the package's public-domain texts, streamed or not (alternating), greedy, `n_predict` 16-64. For the
squeezed prefix every prompt starts with the prefix document and asks about it, so each runs over the prepared
prefix; "dense-prefix" sends the same requests to a dense server (whose slots reuse the prefix from their prompt
caches), the baseline of the squeezed one. Reported per configuration: requests that failed (HTTP error, a broken
stream, a reply without its stop reason; target 0), answers the model ended at once (empty: the model's, not
failures), p50 / p99 latency of a request, generated tokens per second over the run, and the server's resident
memory sampled every second (start, peak, end).

    python bench/server_soak.py                               # dense, sparq, dense-prefix, squeeze: 100 requests each
    python bench/server_soak.py --configs sparq --requests 20 # a quick check
Writes bench/results/server_soak.json (every request's status and latency, the memory samples).
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from record import RESULTS, provenance, write_record
from sparq_llama import texts
from sparq_llama.models import fetch

CONFIGS = {
    "dense": [],
    "sparq": ["--sparq", "--sparq-min-kv", "0"],          # SparQ on every step, short prompts included
    "dense-prefix": [],                                    # the squeeze requests, dense (the slots' prompt caches)
    "squeeze": ["--squeeze", "--squeeze-prefix-file"],     # + the document's path
}
WITH_PREFIX = ("dense-prefix", "squeeze")
N_SLOTS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    """Resident memory of a process (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Server:
    def __init__(self, binary: str, model: Path, args: list[str], n_ctx: int, threads: int, log: Path) -> None:
        self.port = free_port()
        self.log = log
        cmd = [binary, "-m", str(model), "-c", str(n_ctx * N_SLOTS), "-np", str(N_SLOTS), "-t", str(threads),
               "--port", str(self.port), "--host", "127.0.0.1", *args]
        self.cmd = " ".join(cmd)
        # threads that sleep while they wait: on a machine shared with other work, OpenMP's spinning workers slowed
        # llama.cpp's tools many times over (unless the caller chose a policy)
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
        self.env = {"OMP_WAIT_POLICY": env["OMP_WAIT_POLICY"]}
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError("llama-server did not become healthy in 600 s")
            time.sleep(0.5)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        t0 = time.time()
        while not self._stop.is_set():
            self.samples.append((round(time.time() - t0, 1), rss_kib(self.proc.pid)))
            self._stop.wait(1.0)

    def request(self, prompt: str, n_predict: int, stream: bool) -> dict[str, Any]:
        """One /completion; its outcome (ok, error), latency and generated tokens."""
        body = json.dumps({"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "stream": stream,
                           "cache_prompt": True}).encode()
        t0 = time.time()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                return dict(ok=False, error=f"HTTP {resp.status}: {resp.read()[:300]!r}", s=time.time() - t0)
            if not stream:
                reply = json.loads(resp.read())
            else:
                text, reply = "", None
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    text += event.get("content", "")
                    if event.get("stop"):
                        reply = {**event, "content": text}
                        break
                if reply is None:
                    return dict(ok=False, error="the stream ended without its final event", s=time.time() - t0)
            stop = reply.get("stop_type", "")
            if stop not in ("eos", "limit", "word"):
                return dict(ok=False, error=f"no stop reason in the reply ({stop!r})", s=time.time() - t0)
            # an answer the model ends at once (end of sequence first) is the model's, not a failure of the server
            return dict(ok=True, s=time.time() - t0, n_gen=reply.get("tokens_predicted", 0), stop=stop,
                        empty=not reply.get("content"))
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            return dict(ok=False, error=f"{type(e).__name__}: {e}", s=time.time() - t0)
        finally:
            conn.close()

    def close(self) -> None:
        if hasattr(self, "_stop"):
            self._stop.set()
            self._sampler.join(timeout=5)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prompts(n: int, n_ctx: int, prefix: str | None, seed: int) -> list[tuple[str, int, bool]]:
    """(prompt, n_predict, stream) per request: slices of the texts of 200 characters to ~2.5 characters per token of
    half a slot, each after the prefix where there is one."""
    rng = random.Random(seed)
    corpus = "\n".join(texts.read(name) for name in texts.names())
    out = []
    for i in range(n):
        size = int(rng.choice([200, 800, 2000, int(n_ctx * 1.25)]) if prefix is None else rng.choice([100, 300]))
        start = rng.randrange(0, len(corpus) - size)
        body = corpus[start:start + size]
        text = body if prefix is None else f"{prefix}\n\nQuestion: what follows the line \"{body[:80]}\"?\nAnswer:"
        out.append((text, rng.randint(16, 64), i % 2 == 0))
    return out


def soak(server: Server, work: list[tuple[str, int, bool]], clients: int) -> dict[str, Any]:
    t0 = time.time()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda w: server.request(*w), work))
    wall = time.time() - t0
    lat = sorted(r["s"] for r in results if r["ok"])
    mem = [kib for _, kib in server.samples if kib]
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
    return dict(n=len(results), errors=sum(not r["ok"] for r in results), empty=sum(r.get("empty", 0) for r in results),
                error_examples=[r["error"] for r in results if not r["ok"]][:5],
                p50_s=q[49], p99_s=q[98], wall_s=round(wall, 1),
                gen_tps=sum(r.get("n_gen", 0) for r in results) / wall,
                rss_mib=dict(start=mem[0] / 1024, peak=max(mem) / 1024, end=mem[-1] / 1024) if mem else None,
                rss_samples=server.samples, requests=results)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--clients", type=int, default=8, help="requests in flight at once (slots: 4)")
    ap.add_argument("--n-ctx", type=int, default=2048, help="cells per slot")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "server_soak.json")
    args = ap.parse_args()
    configs = args.configs.split(",")
    if any(c not in CONFIGS for c in configs):
        ap.error(f"--configs: one of {', '.join(CONFIGS)}")
    binary = shutil.which("llama-server") or str(Path(sys.executable).parent / "llama-server")
    model = fetch(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))
    play = texts.read(texts.names()[0])
    prefix = play[:play.rindex("\n", 0, 4000) + 1]   # ~1k tokens ending a line: the squeezed document
    (tmp / "doc.txt").write_text(prefix)
    rows = {}
    for name in configs:
        extra = CONFIGS[name] + ([str(tmp / "doc.txt")] if name == "squeeze" else [])
        server = Server(binary, model, extra, args.n_ctx, args.threads, tmp / f"{name}.log")
        try:
            work = prompts(args.requests, args.n_ctx, prefix if name in WITH_PREFIX else None, args.seed)
            rows[name] = dict(command=server.cmd, env=server.env, **soak(server, work, args.clients))
        finally:
            server.close()
        r = rows[name]
        print(f"{name:>12}: {r['n']} requests, {r['errors']} errors, {r['empty']} empty answers, p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s, "
              f"{r['gen_tps']:.1f} generated tok/s, RSS MiB start/peak/end "
              f"{r['rss_mib']['start']:.0f}/{r['rss_mib']['peak']:.0f}/{r['rss_mib']['end']:.0f}", flush=True)
    write_record(args.out, dict(provenance("server_soak"), params=vars(args) | {"out": str(args.out)},
                                slots=N_SLOTS, configs=rows))
    return 0 if all(r["errors"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
