"""ema.attach(optimizer): one update after every real optimizer step, checked against a float64
EMA computed by hand from the model's weights after each step: plain loops, gradient accumulation,
a real torch.amp.GradScaler skipping steps with inf gradients (an optimizer it skips, and a fused
Adam that it calls with found_inf), removal, refusals, and the weak references."""

import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import fused_ema
from ema_helpers import small_mlp

DECAY = 0.8


class Reference:
    """The EMA by hand in float64: the first update copies, then lerps with weight 1 - decay."""

    def __init__(self):
        self.state, self.updates = None, 0

    def update(self, model):
        now = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
        if self.state is None:
            self.state = now
        else:
            for k, v in now.items():
                if v.is_floating_point() and k != "1.num_batches_tracked":
                    self.state[k] += (1 - DECAY) * (v - self.state[k])
                else:
                    self.state[k] = v
        self.updates += 1

    def check(self, ema):
        weights = ema.state_dict()["weights"]
        for k, v in self.state.items():
            torch.testing.assert_close(weights[k].double(), v, rtol=1e-6, atol=1e-6, msg=k)


def batch(g):
    return torch.randn(16, 6, generator=g)


def loss_of(model, x):
    return model(x).square().mean()


def test_updates_once_per_step():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    handle = ema.attach(opt)
    ref, g = Reference(), torch.Generator().manual_seed(0)
    for _ in range(6):
        opt.zero_grad()
        loss_of(model, batch(g)).backward()
        opt.step()
        ref.update(model)
    assert ema.step == 6
    ref.check(ema)
    handle.remove()
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    loss_of(model, batch(g)).backward()
    opt.step()
    assert ema.step == 6
    for k, v in ema.state_dict()["weights"].items():
        assert torch.equal(v, before[k]), k


def test_gradient_accumulation_updates_once_per_optimizer_step():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema.attach(opt)
    ref, g = Reference(), torch.Generator().manual_seed(1)
    accumulate = 4
    for micro in range(1, 5 * accumulate + 1):
        (loss_of(model, batch(g)) / accumulate).backward()
        if micro % accumulate == 0:
            opt.step()
            opt.zero_grad()
            ref.update(model)
    assert ema.step == ref.updates == 5
    ref.check(ema)


def test_accelerates_wrapped_optimizer_updates_once_per_real_step():
    """accelerator.prepare's AcceleratedOptimizer (an Optimizer subclass that is not initialised
    as one): attach raised AttributeError; it now hooks the optimizer it wraps, whose step runs
    only on real steps under accelerator.accumulate."""
    accelerate = pytest.importorskip("accelerate")
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    accumulate = 4
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ema.attach(opt)
    ref, g = Reference(), torch.Generator().manual_seed(1)
    for micro in range(1, 3 * accumulate + 1):
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model, batch(g)))
            opt.step()
            opt.zero_grad()
        if micro % accumulate == 0:
            ref.update(model)
    assert ema.step == ref.updates == 3
    ref.check(ema)


@pytest.mark.parametrize("fused", [False, True], ids=["skipped-by-scaler", "fused-adam-found-inf"])
def test_a_gradscaler_skipped_step_is_not_an_update(fused):
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    if fused:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ema.attach(opt)
    ref, g = Reference(), torch.Generator().manual_seed(2)
    skipped = {2, 5}
    for step in range(7):
        opt.zero_grad()
        scaler.scale(loss_of(model, batch(g))).backward()
        if step in skipped:
            model[0].weight.grad[0, 0] = float("inf")
        weights_before = {k: v.clone() for k, v in model.state_dict().items()}
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if step in skipped:
            assert scaler.get_scale() < scale  # the scaler did see the inf and skip
            for k, v in model.state_dict().items():
                assert torch.equal(v, weights_before[k]), k
        else:
            ref.update(model)
    assert ema.step == ref.updates == 7 - len(skipped)
    ref.check(ema)


def test_counts_from_a_restored_step_with_its_warmup():
    model = small_mlp()
    source = fused_ema.ModelEma(model, 0.99, warmup=True)
    for _ in range(10):
        source.update(model)
    ema = fused_ema.ModelEma(model, 0.99, warmup=True)
    ema.load_state_dict(source.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema.attach(opt)
    for step in range(11, 14):
        loss_of(model, torch.randn(4, 6)).backward()
        opt.step()
        assert ema.step == step and ema.current_decay == ema.get_decay(step)


def test_one_optimizer_at_a_time_and_clear_refusals():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="Optimizer"):
        ema.attach(object())
    with pytest.raises(TypeError, match="nn.Module"):
        ema.attach(opt, model="model")
    with pytest.raises(TypeError, match="non_blocking"):
        ema.attach(opt, non_blocking=1)
    assert not opt._optimizer_step_post_hooks  # nothing registered by a refused call
    handle = ema.attach(opt)
    with pytest.raises(RuntimeError, match="already attached"):
        ema.attach(other)
    handle.remove()
    gc.collect()
    ema.attach(other).remove()  # allowed once the first is removed
    ema.attach(opt)
    copy = pickle.loads(pickle.dumps(ema))  # a copy is not attached
    loss_of(model, torch.randn(4, 6)).backward()
    opt.step()
    assert ema.step == 1 and copy.step == 0
    copy.attach(other).remove()


def test_a_structure_change_raises_from_step_and_changes_nothing():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema.attach(opt)
    loss_of(model, torch.randn(4, 6)).backward()
    opt.step()
    before = {k: v.clone() for k, v in ema.state_dict()["weights"].items()}
    model[3] = nn.Linear(16, 4)
    with pytest.raises(fused_ema.StructureMismatchError):
        opt.step()
    assert ema.step == 1
    for k, v in ema.state_dict()["weights"].items():
        assert torch.equal(v, before[k]), k


def test_the_hook_holds_the_ema_weakly():
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema.attach(opt)
    dead = weakref.ref(ema)
    del ema
    gc.collect()
    assert dead() is None  # the optimizer does not keep it alive
    loss_of(model, torch.randn(4, 6)).backward()
    opt.step()  # and stepping without it is fine


def test_an_explicit_model_and_non_blocking():
    model = small_mlp()
    blocking = fused_ema.ModelEma(model, DECAY)
    background = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocking.attach(opt, model)
    for _ in range(3):
        loss_of(model, torch.randn(4, 6)).backward()
        opt.step()
        background.update(model, non_blocking=True)
    background.synchronize()
    assert blocking.step == background.step == 3
    for k, v in blocking.state_dict()["weights"].items():
        assert torch.equal(v, background.state_dict()["weights"][k]), k
    third = fused_ema.ModelEma(model, DECAY)
    other_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    third.attach(other_opt, non_blocking=True)
    loss_of(model, torch.randn(4, 6)).backward()
    other_opt.step()
    assert third.step == 1  # reading the step waits for the background update


def test_removed_in_the_except_block_of_its_own_error_it_attaches_again():
    """The traceback of an error the hook raised keeps the removed hook alive: removed is what
    the optimizer no longer holds, so an `except` block can resync and attach again."""
    model = small_mlp()
    ema = fused_ema.ModelEma(model, DECAY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = ema.attach(opt)
    loss_of(model, torch.randn(4, 6)).backward()
    opt.step()
    model[3] = nn.Linear(16, 4)
    try:
        opt.step()
    except fused_ema.StructureMismatchError:
        with pytest.raises(RuntimeError, match="already attached"):
            ema.attach(opt)  # not removed yet
        handle.remove()
        ema.resync(model)
        ema.attach(opt)
    ref = Reference()
    ref.state = {k: v.double().clone() for k, v in ema.state_dict()["weights"].items()}
    loss_of(model, torch.randn(4, 6)).backward()
    opt.step()
    ref.update(model)
    assert ema.step == 2
    ref.check(ema)


@pytest.mark.parametrize("point", ["call", "line"])
def test_an_interrupted_attach_leaves_no_hook_acting(point):
    """attach() interrupted at any point left its hook registered once the optimizer held it,
    without a handle the caller could remove: it updated the EMA at every step, twice a step once
    attached again (or refused the second attach). Now an interrupted attach leaves nothing that
    updates, a later attach works, and each step updates the EMA once."""
    from interrupts import InterruptAt, InterruptAtLine, interrupted_everywhere

    torch.manual_seed(5)
    model = small_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = fused_ema.ModelEma(model, 0.9)
    got = {}

    def step():
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()

    def after(interrupted):
        before = ema.step
        step()
        assert ema.step == before + (0 if interrupted else 1)
        handle = ema.attach(opt) if interrupted else got.pop("handle")
        step()
        assert ema.step == before + (1 if interrupted else 2)
        handle.remove()
        step()
        assert ema.step == before + (1 if interrupted else 2)

    def call():
        got["handle"] = ema.attach(opt)

    kind = InterruptAt if point == "call" else InterruptAtLine
    assert interrupted_everywhere(call, after, point=kind)
