"""The main job (`sparq-llama demo`) runs on the real model and reports its speed."""
import re
import shutil

from conftest import run


def test_demo_generates_and_reports_tokens_per_second(smollm2_path):
    res = run([shutil.which("sparq-llama"), "demo", "--prompt-tokens", "600", "--max-tokens", "8",
               "--n-ctx", "1024"], timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "generated after 600 prompt tokens of hamlet_gut" in res.stdout
    m = re.search(r"prefill ([\d.]+) tokens/s, decode ([\d.]+) tokens/s \((\d+) tokens", res.stdout)
    assert m, res.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0 and 1 <= int(m.group(3)) <= 8


def test_demo_rejects_a_prompt_longer_than_the_context():
    res = run([shutil.which("sparq-llama"), "demo", "--prompt-tokens", "4000", "--n-ctx", "1024"], timeout=120)
    assert res.returncode == 1 and "> n_ctx" in res.stderr
