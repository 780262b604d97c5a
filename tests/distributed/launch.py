"""Runs a worker script of this folder as a real multi-process job (torchrun, one process per
rank) under a hard time limit and returns each rank's JSON result. Shared by test_distributed.py
and test_ema_shard.py. A port taken between choosing it and binding it, or gloo aborting a rank
while the job tears down ("terminate called without an active exception", seen under load on 2
cores), gets another try, up to ATTEMPTS runs in all."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

TIME_LIMIT_S = 240
RETRIED = ("address already in use", "terminate called without an active exception")
ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(worker: Path, scenario: str, out: Path, nproc: int, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for attempt in range(ATTEMPTS):
        for stale in out.glob(f"{scenario}_rank*.json"):
            stale.unlink()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(worker),
            scenario,
            str(out),
            *args,
        ]
        try:
            result = subprocess.run(
                cmd, capture_output=True, text=True, timeout=TIME_LIMIT_S, env=env
            )
        except subprocess.TimeoutExpired as err:
            pytest.fail(f"{scenario} did not finish in {err.timeout} s")
        output = result.stdout[-2000:] + result.stderr[-6000:]
        last = attempt == ATTEMPTS - 1
        if result.returncode == 0 or last or not any(r in output.lower() for r in RETRIED):
            break
    assert result.returncode == 0, output
    ranks = [json.loads((out / f"{scenario}_rank{r}.json").read_text()) for r in range(nproc)]
    for r in ranks:
        assert "crashed" not in r, r.get("crashed")
    return ranks
