"""ModelEma.update as one transaction in the cases a fault injector finds: an interrupt between an
update landing and its commit (a later failing call must not roll that step back), and two
threads updating one EMA (refused, never torn)."""

import threading

import pytest
import torch
from torch import nn

import fused_ema
from fused_ema._update.schedule import Schedule


def test_an_update_interrupted_before_its_commit_is_not_rolled_back_later(monkeypatch):
    model = nn.Linear(4, 4)
    ema = fused_ema.ModelEma(model, decay=0.5)
    ema.update(model)
    ema.update(model)
    commit = Schedule.commit
    calls = []

    def interrupted_commit(self):
        if self._dirty and not calls:  # the commit of a begun step
            calls.append(1)
            raise KeyboardInterrupt  # lands just before the step is committed
        commit(self)

    monkeypatch.setattr(Schedule, "commit", interrupted_commit)
    with torch.no_grad():
        model.weight.add_(1.0)
    # A step tensor: the update that begins and commits a step in Python (a prepared update's
    # steady state, one call with an int step or none, has no such window).
    with pytest.raises(KeyboardInterrupt):
        ema.update(model, step=torch.tensor(3))
    landed = ema.state_dict()["weights"]["weight"].clone()
    assert ema.step == 3  # the update itself landed whole
    model.extra = nn.Linear(2, 2)
    with pytest.raises(fused_ema.StructureMismatchError):
        ema.update(model)
    assert ema.step == 3
    assert torch.equal(ema.state_dict()["weights"]["weight"], landed)


@pytest.mark.parametrize("non_blocking", [False, True])
def test_two_threads_updating_one_ema_never_tear_it(non_blocking):
    model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(4)])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ema = fused_ema.ModelEma(model, decay=0.999, warmup=True)  # a new weight every step
    ema.update(model)
    with torch.no_grad():
        for p in ema.state_dict()["weights"].values():
            p.zero_()
    refused, done = [], []
    start = threading.Barrier(2)

    def worker():
        start.wait()
        for _ in range(10):
            try:
                ema.update(model, non_blocking=non_blocking)
                done.append(1)
            except RuntimeError as err:
                assert "another thread" in str(err)
                refused.append(1)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ema.synchronize()
    assert len(done) + len(refused) == 20 and ema.step == 1 + len(done)
    kept = 1.0
    for step in range(2, ema.step + 1):  # every update that ran, once and whole
        kept *= ema.get_decay(step)
    for name, value in ema.state_dict()["weights"].items():
        torch.testing.assert_close(value, torch.full_like(value, 1 - kept), msg=name)
