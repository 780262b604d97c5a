"""One rank of the DeepSpeed ZeRO-3 test (tests/test_zero3.py), started through torchrun:

    python -m torch.distributed.run --nproc-per-node=2 zero3_worker.py train OUT_DIR

Trains a small ZeRO-3 model on the CPU (gloo) next to a float64 EMA of its gathered parameters,
computed by hand, and unsharded twins of each EMA; then uses the EMA (swapped, full_state_dict,
checkpoints, copy_to) and writes OUT_DIR/train_rank{R}.json with what it measured.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed picks an accelerator

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402

import fused_ema  # noqa: E402
from fused_ema._dist import zero3  # noqa: E402

STEPS = 6
DECAY = 0.9
# Parameters of at most this many elements stay whole on every rank after a step (ds_persist).
PERSIST = 5
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSIST},
}
# Collectives that update() must never call (counted, besides CommDebugMode's dispatcher view).
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "send",
    "recv",
)


class Net(nn.Module):
    """Sizes that do not divide by 2 (a partition padded at the end), a 1-element persistent
    bias (rank 1's partition holds none of it) and an averaged float buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)  # 91 + 13
        self.b = nn.Linear(13, 5)  # 65 + 5
        self.c = nn.Linear(5, 1)  # 5 + 1 (persistent)
        self.register_buffer("shift", torch.zeros(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) + self.shift.sum()


class Counter:
    """Counts calls of torch.distributed's collectives while active."""

    def __init__(self):
        self.calls = 0
        self.saved = {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self.saved[name] = original

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def gathered(module) -> dict:
    """Every parameter whole, as float64 (a collective: outside update() only)."""
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().double().clone() for n, p in module.named_parameters()}


def train(out: Path, rank: int) -> dict:
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Net(), config=CONFIG)
    module = engine.module
    ema = fused_ema.ModelEma(module, decay=DECAY)
    unwraps = fused_ema.ModelEma(engine, decay=DECAY).names() == ema.names()  # the engine itself
    # 16-bit stochastic rounding, drawn by each element's index in the full tensor: the same
    # bits as the EMA of an unsharded copy holding the gathered values.
    sr_ema = fused_ema.ModelEma(module, decay=DECAY, dtype=torch.bfloat16)
    mirror = Net()
    full = gathered(module)
    mirror.load_state_dict({**full, "shift": module.shift}, strict=True)
    sr_mirror = fused_ema.ModelEma(mirror, decay=DECAY, dtype=torch.bfloat16)
    deferred = fused_ema.ModelEma(module, decay=DECAY)  # non_blocking: the worker thread averages
    # copy_names: b's partitions (b.bias persistent) copied, not averaged; blocking and non_blocking
    copying = [fused_ema.ModelEma(module, decay=DECAY, copy_names="b") for _ in range(2)]
    # K tracks from one read (lerp_many_) and BEMA's three lists (bema_), each against the same
    # kind on the unsharded mirror: the partitions must equal its slices bit for bit.
    sets = [
        (_scheduled(module), _scheduled(mirror)),
        (fused_ema.PostHocEma(module), fused_ema.PostHocEma(mirror)),
        (
            fused_ema.Bema(module, update_freq=1, lag=2),
            fused_ema.Bema(mirror, update_freq=1, lag=2),
        ),
    ]
    reference = {**full, "shift": module.shift.double().clone()}
    layout_ok, collectives, dispatched = True, 0, 0
    for step in range(1, STEPS + 1):
        g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x = torch.randn(4, 7, generator=g)
        engine.backward(engine(x).square().mean())
        engine.step()
        module.shift.add_(0.25)  # a buffer the model changes: averaged whole
        with Counter() as counter, CommDebugMode() as comm:
            ema.update(module)
            sr_ema.update(module)
            for tracked, _ in sets:
                tracked.update(module)
            deferred.update(module, non_blocking=True)
            deferred.synchronize()
            copying[0].update(module)
            copying[1].update(module, non_blocking=True)
            copying[1].synchronize()
        collectives += counter.calls
        dispatched += comm.get_total_counts()
        full = gathered(module)
        layout_ok &= all(
            torch.equal(zero3.partition(p).double(), full[n].reshape(-1).narrow(0, *_span(p)))
            for n, p in module.named_parameters()
        )
        decay = 0.0 if step == 1 else DECAY  # the first update copies the model
        current = {**full, "shift": module.shift.double()}
        for name, value in current.items():
            reference[name] = decay * reference[name] + (1 - decay) * value
        with torch.no_grad():
            for name, p in mirror.named_parameters():
                p.copy_(full[name])
            mirror.shift.copy_(module.shift)
        sr_mirror.update(mirror)
        for _, unsharded in sets:
            unsharded.update(mirror)

    tracks_equal = all(
        _partitions_equal(module, mine.state_dict()["weights"], full.state_dict()["weights"])
        for tracked, unsharded in sets
        for mine, full in zip(_tracks(tracked), _tracks(unsharded), strict=True)
    )
    weights = ema.state_dict()["weights"]
    deferred_equal = _partitions_equal(
        module,
        deferred.state_dict()["weights"],
        {
            n: (
                zero3.gather_full(v, p)
                if (p := dict(module.named_parameters()).get(n)) is not None
                else v
            )
            for n, v in weights.items()
        },
    )
    copies_equal = [_copies_equal(module, c, weights) for c in copying]
    sr_weights = sr_ema.state_dict()["weights"]
    sr_full = sr_mirror.state_dict()["weights"]
    params = dict(module.named_parameters())
    errors, sr_equal, shapes = {}, True, {}
    for name, value in weights.items():
        if name in params:
            p = params[name]
            start, length = _span(p)
            expected = reference[name].reshape(-1).narrow(0, start, length)
            mine_sr = sr_weights[name]
            sr_equal &= torch.equal(mine_sr, sr_full[name].reshape(-1).narrow(0, start, length))
            shapes[name] = {"ema": list(value.shape), "valid": length, "persist": p.ds_persist}
        else:  # a buffer: whole on every rank
            expected = reference[name]
            sr_equal &= torch.equal(sr_weights[name], sr_full[name])
            shapes[name] = {"ema": list(value.shape)}
        errors[name] = float((value.double() - expected).abs().max()) if value.numel() else 0.0

    # 100 more updates: still no collective. Outside CommDebugMode (a dispatch mode, which the
    # prepared update steps aside for) they run as one prepared call each, the steady state.
    runs, copy_runs = _prepared_runs(ema), _prepared_runs(copying[0])
    with Counter() as counter:
        for _ in range(100):
            ema.update(module)
            copying[0].update(module)
        dist.all_reduce(torch.zeros(1))  # one on purpose: the counters do see collectives
    copy_prepared = _copied_partitions_follow(module, copying[0], copy_runs)
    reference6 = {n: v.clone() for n, v in reference.items()}  # sr_ema's: it stopped at step 6
    for _ in range(100):  # the model did not change: the same toward the same values
        for name, value in current.items():
            reference[name] = DECAY * reference[name] + (1 - DECAY) * value
    with CommDebugMode() as comm:
        dist.all_reduce(torch.zeros(1))
    swapped = _swapped(engine, module, ((ema, reference), (sr_ema, reference6)), rank)
    full = _full_state_dict(module, ema, reference, rank)
    checkpoints = _checkpoints(module, ema, rank)
    copied = _copy_to(engine, module, ema, rank)
    mismatch = _structure_change(module, ema)
    return {
        "swapped": swapped,
        "unwraps": unwraps,
        "tracks_equal": tracks_equal,
        "deferred_equal": deferred_equal,
        "copies_equal": copies_equal,
        "copy_prepared": copy_prepared,
        "copied": copied,
        "mismatch": mismatch,
        "full": full,
        "checkpoints": checkpoints,
        "prepared_runs": _prepared_runs(ema) - runs,
        "errors": errors,
        "sr_equal": sr_equal,
        "layout_ok": layout_ok,
        "shapes": shapes,
        "collectives_in_update": collectives + counter.calls - 1,
        "dispatched_in_update": dispatched,
        "counter_saw_probe": counter.calls == 1 and comm.get_total_counts() >= 1,
        "step": ema.step,
        "ema_numel": sum(v.numel() for n, v in weights.items() if n in params),
        "model_numel": sum(p.ds_numel for p in params.values()),
    }


def before_init(out: Path, rank: int) -> dict:
    """EMAs built from the whole model before deepspeed.initialize partitions it (the order of
    accelerate scripts), against twins built after: each rank keeps its slice of the whole EMA at
    the first update (or resync), with no collective, then averages as the twins do."""
    torch.manual_seed(0)
    net = Net()
    early = [fused_ema.ModelEma(net, decay=DECAY) for _ in range(3)]  # updated, resynced, loaded
    early_posthoc = fused_ema.PostHocEma(net)
    whole = early[2].state_dict()
    engine, *_ = deepspeed.initialize(model=net, config=CONFIG)
    module = engine.module
    twin, twin_posthoc = fused_ema.ModelEma(module, decay=DECAY), fused_ema.PostHocEma(module)
    try:
        with early[0].swapped(module):
            pass
        refused = False
    except RuntimeError as err:
        refused = "partitioned" in str(err) and early[0].state_dict()["weights"].keys() == {
            n for n, _ in net.named_parameters()
        } | {"shift"}
    early[1].resync(module)
    early[2].load_state_dict(whole)  # whole values into whole tensors: sliced at the update
    collectives = 0
    for step in range(1, 4):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))
        engine.backward(engine(x).square().mean())
        engine.step()
        with Counter() as counter:
            for ema in (*early, early_posthoc, twin, twin_posthoc):
                ema.update(module)
        collectives += counter.calls
    mine = [_weights(ema) for ema in (*early, early_posthoc)]
    theirs = [_weights(twin)] * 3 + [_weights(twin_posthoc)]
    return {
        "refused": refused,
        "equal": [
            all(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a) for a, b in pairs)
            for pairs in (zip(m, t, strict=True) for m, t in zip(mine, theirs))
        ],
        "sliced": all(
            early[0].state_dict()["weights"][n].shape == (zero3.valid_numel(p),)
            for n, p in module.named_parameters()
        ),
        "collectives": collectives,
    }


def _scheduled(model):
    return fused_ema.ModelEma(model, decay=DECAY, warmup=True, update_every=2)


def _bema(model):
    return fused_ema.Bema(model, update_freq=1, lag=2)


def _tracks(tracked) -> list:
    """The ModelEmas of a PostHocEma or Bema (EMA, theta0 and corrected weights), or the one."""
    return list(getattr(tracked, "_tracks", (tracked,)))


def _partitions_equal(module, mine: dict, full: dict) -> bool:
    params = dict(module.named_parameters())
    return set(mine) == set(full) and all(
        torch.equal(v, full[n].reshape(-1).narrow(0, *_span(params[n])))
        if n in params
        else torch.equal(v, full[n])
        for n, v in mine.items()
    )


def _swapped(engine, module, emas, rank) -> dict:
    """Forwards inside ema.swapped(module) (the fp32 EMA, then the bf16 one: cast both ways) against
    an unsharded model holding each one's float64 reference; the training weights after each."""
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(5, 7, generator=g)
    with torch.no_grad():
        before = engine(x)
    full_before = gathered(module)
    out = {}
    for name, (averager, reference) in zip(("fp32", "bf16"), emas):
        mirror = Net().double()
        mirror.load_state_dict(reference, strict=True)
        with torch.no_grad():
            expected = mirror(x.double())
        with averager.swapped(module), torch.no_grad():
            inside = engine(x)
            inside_again = engine(x)  # after DeepSpeed may have kept gathered parameters
        try:  # a block that raises: the training weights come back all the same
            with averager.swapped(module):
                raise ValueError("inside")
        except ValueError:
            pass
        with torch.no_grad():
            through_module = averager.module(x)  # ema.module runs the model swapped
            after = engine(x)
        full_after = gathered(module)
        out[name] = {
            "error": float((inside.double() - expected).abs().max()),
            "repeatable": torch.equal(inside, inside_again) and torch.equal(through_module, inside),
            "restored": torch.equal(after, before)
            and all(torch.equal(full_after[n], full_before[n]) for n in full_before),
        }
    return out


def _full_state_dict(module, ema, reference, rank) -> dict:
    """full_state_dict(rank=0): whole tensors on rank 0 only, under the model's names and shapes,
    equal to the float64 reference EMA; the unsharded checkpoint loads into an unsharded EMA."""
    full = ema.full_state_dict(rank=0)
    if rank != 0:
        return {"empty": full == {}}
    mirror = Net()
    unsharded = fused_ema.ModelEma(mirror, decay=DECAY)
    unsharded.load_state_dict({**ema.state_dict(), "weights": full})
    loaded = unsharded.state_dict()["weights"]
    params = module.named_parameters()
    return {
        "shapes_ok": all(list(full[n].shape) == list(p.ds_shape) for n, p in params),
        "error": max(float((full[n].double() - reference[n]).abs().max()) for n in reference),
        "loaded": all(torch.equal(loaded[n], full[n]) for n in full),
        "step": unsharded.step,
    }


def _checkpoints(module, ema, rank) -> dict:
    """A rank's state_dict() reloads; another rank's is refused with nothing changed: its weights
    in this rank's dict by their shapes, and its dict by the rank it records, even holding weights
    of this rank's shapes (ranks' partitions of the same length look alike); a whole (unsharded)
    checkpoint loads into a fresh ZeRO-3 EMA, each rank taking its partition."""
    own = ema.state_dict()
    mine = {n: v.clone() for n, v in own["weights"].items()}
    theirs = [None, None]
    dist.all_gather_object(theirs, own)
    refusals = []
    for other in (
        {**own, "weights": theirs[1 - rank]["weights"]},
        {**theirs[1 - rank], "weights": mine},
    ):
        try:
            ema.load_state_dict(other)
            refusals.append("")
        except fused_ema.CheckpointError as err:
            refusals.append(str(err))
    unchanged = all(torch.equal(v, mine[n]) for n, v in ema.state_dict()["weights"].items())
    ema.load_state_dict(own)
    reloaded = all(torch.equal(v, mine[n]) for n, v in ema.state_dict()["weights"].items())
    whole = [ema.full_state_dict(rank=None)]  # every rank keeps it
    fresh = fused_ema.ModelEma(module, decay=DECAY)
    fresh.load_state_dict({**own, "weights": whole[0]})
    params = dict(module.named_parameters())
    taken = all(
        torch.equal(v, mine[n]) if n in params else torch.equal(v, whole[0][n])
        for n, v in fresh.state_dict()["weights"].items()
    )
    return {
        "refused_other_rank": "ZeRO-3 partition" in refusals[0] and unchanged,
        "refused_other_rank_dict": f"partitions of rank {1 - rank} of 2" in refusals[1],
        "records_rank": own.get("zero3_partition") == {"rank": rank, "world": 2},
        "reloaded": reloaded,
        "whole_taken": taken and fresh.step == ema.step,
    }


def _structure_change(module, ema) -> dict:
    """A parameter added to the model (the last thing this worker does: DeepSpeed does not
    partition it): on_mismatch="error" refuses the update with nothing changed, resync follows."""
    before = {n: v.clone() for n, v in ema.state_dict()["weights"].items()}
    step = ema.step
    module.register_parameter("extra", nn.Parameter(torch.ones(2)))
    refused = False
    try:
        ema.update(module)
    except fused_ema.StructureMismatchError as err:
        refused = "extra" in str(err)
    after = ema.state_dict()["weights"]
    unchanged = ema.step == step and all(torch.equal(after[n], v) for n, v in before.items())
    ema.resync(module)  # the new parameter is followed (its EMA starts from it), the rest kept
    kept = all(torch.equal(ema.state_dict()["weights"][n], v) for n, v in before.items())
    return {"refused": refused and unchanged, "followed": "extra" in ema.names() and kept}


def _copy_to(engine, module, ema, rank) -> dict:
    """ema.copy_to(module): each rank's partitions and fp32 master partitions hold the EMA, a
    forward sees it, and the next optimizer step starts from it."""
    from deepspeed.utils import safe_get_local_fp32_param

    ema.copy_to(module)
    weights = ema.state_dict()["weights"]
    params = dict(module.named_parameters())

    def master(p):
        return safe_get_local_fp32_param(p)[: zero3.valid_numel(p)]

    partitions = all(torch.equal(zero3.partition(p), weights[n]) for n, p in params.items())
    masters = all(torch.equal(master(p), weights[n]) for n, p in params.items())
    g = torch.Generator().manual_seed(700 + rank)
    x = torch.randn(4, 7, generator=g)
    mirror = Net()
    full = {n: zero3.gather_full(weights[n], p) for n, p in params.items()}
    mirror.load_state_dict({**full, "shift": module.shift}, strict=True)
    with torch.no_grad():
        seen = torch.equal(engine(x), mirror(x))  # the next forward gathers the EMA
    engine.backward(engine(x).square().mean())
    engine.step()
    stepped = all(torch.equal(zero3.partition(p), master(p)) for p in params.values())
    moved = max(
        float((master(p) - weights[n]).abs().amax())
        for n, p in params.items()
        if zero3.valid_numel(p)
    )
    return {
        "partitions": partitions,
        "masters": masters,
        "seen": seen,
        "stepped": stepped,
        "moved": moved,
    }


def trainer(out: Path, rank: int) -> dict:
    """EMACallback and BEMACallback under a ZeRO-3 Hugging Face Trainer: ema.pt and bema.pt are
    written whole at step 2 (every rank joins the gather), and a run resumed from that checkpoint
    restores each rank's partitions exactly as they were at step 2."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fused_ema.integrations.transformers import BEMACallback, EMACallback

    class Regressor(Net):
        def forward(self, x, labels):  # the Trainer wants the loss in a dict
            return {"loss": (super().forward(x).squeeze(-1) - labels).square().mean()}

    class Capture(TrainerCallback):
        """Each callback's EMA weights at step 2 (first run), or once restored (resumed run)."""

        def __init__(self, callbacks, when):
            self.callbacks, self.when, self.seen = callbacks, when, None

        def _take(self):
            self.seen = [_weights(c.ema) for c in self.callbacks]

        def on_train_begin(self, args, state, control, **kwargs):
            if self.when == "begin":
                self._take()

        def on_step_end(self, args, state, control, **kwargs):
            if self.when == "step2" and state.global_step == 2:
                self._take()

    g = torch.Generator().manual_seed(7)
    data = [
        {"x": torch.randn(7, generator=g), "labels": torch.randn((), generator=g)}
        for _ in range(64)
    ]

    # The model saved whole: the Trainer's other path writes and removes a dummy file from every
    # process, which races on the CPU (where both processes count as the main one).
    zero = {**CONFIG["zero_optimization"], "stage3_gather_16bit_weights_on_model_save": True}
    config = {**CONFIG, "zero_optimization": zero}

    def run(resume: bool, when: str):
        args = TrainingArguments(
            output_dir=str(out / "trainer"),
            deepspeed=config,
            per_device_train_batch_size=4,
            max_steps=4,
            save_steps=2,
            report_to=[],
            logging_strategy="no",
            learning_rate=0.05,
            ddp_backend="gloo",
            seed=0,
        )
        callbacks = [EMACallback(decay=DECAY), BEMACallback(update_freq=1, lag=2)]
        capture = Capture(callbacks, when)
        torch.manual_seed(0)
        run = Trainer(
            model=Regressor(), args=args, train_dataset=data, callbacks=[*callbacks, capture]
        )
        run.train(resume_from_checkpoint=str(out / "trainer" / "checkpoint-2") if resume else None)
        return capture.seen, [c.ema for c in callbacks]

    saved, (ema, _) = run(False, "step2")
    restored, _ = run(True, "begin")
    whole = torch.load(out / "trainer" / "checkpoint-2" / "ema.pt", weights_only=True)
    params = dict(ema._binding.model_ref().named_parameters())
    return {
        "partitioned": all(
            v.numel() == zero3.valid_numel(params[n]) for n, v in saved[0][0].items() if n in params
        ),
        "written_whole": all(
            list(whole["weights"][n].shape) == list(p.ds_shape) for n, p in params.items()
        ),
        "restored": len(saved) == len(restored) == 2
        and all(
            a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            for mine, theirs in zip(saved, restored)
            for a, b in zip(mine, theirs)
        ),
    }


def accelerate_bf16(out: Path, rank: int) -> dict:
    """What accelerate's prepare returns under a ZeRO-3 DeepSpeed plugin with bf16: ModelEma of
    that engine keeps a float32 EMA of the bfloat16 partitions, read as they are (no staged
    upcast copy), equal to a float64 EMA of the gathered bfloat16 parameters."""
    from accelerate import Accelerator, DeepSpeedPlugin

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": PERSIST},
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    module = accelerator.unwrap_model(model)
    ema = fused_ema.ModelEma(model, decay=DECAY)  # the engine itself
    reference = {}
    for step in range(1, 5):
        g = torch.Generator().manual_seed(300 * step + rank)
        accelerator.backward(model(torch.randn(4, 7, generator=g).bfloat16()).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
        current = {**gathered(module), "shift": module.shift.double()}
        decay = 0.0 if step == 1 else DECAY
        for name, value in current.items():
            reference[name] = decay * reference.get(name, value) + (1 - decay) * value
    weights = ema.state_dict()["weights"]
    params = dict(module.named_parameters())
    return {
        "checkpointed": _accelerate_checkpoint(accelerator, model, ema, out / "accelerate"),
        "engine": type(model).__name__,
        "dtypes": sorted({str(p.ds_tensor.dtype) for p in params.values()})
        + sorted({str(v.dtype) for v in weights.values()}),
        "staged": ema._binding.plan.has_staging,
        "error": max(
            float((v.double() - reference[n].reshape(-1).narrow(0, *_span(params[n]))).abs().max())
            if n in params
            else float((v.double() - reference[n]).abs().max())
            for n, v in weights.items()
            if v.numel()
        ),
    }


def _accelerate_checkpoint(accelerator, model, ema, folder: Path) -> dict:
    """accelerate's save_state / load_state with the EMA registered through WholeCheckpoint: the
    main process writes it whole, and each rank loads its own partitions back exactly."""
    from fused_ema.integrations.accelerate import WholeCheckpoint

    accelerator.register_for_checkpointing(WholeCheckpoint(ema))
    accelerator.save_state(str(folder))
    saved, step = _weights(ema)[0], ema.step
    ema.update(model)  # the EMA moves on toward the model, its step too
    moved = _weights(ema)[0]
    accelerator.load_state(str(folder))
    restored = _weights(ema)[0]
    return {
        "moved": any(not torch.equal(moved[n], saved[n]) for n in saved),
        "restored": restored.keys() == saved.keys()
        and all(torch.equal(restored[n], saved[n]) for n in saved),
        "step": ema.step == step,
    }


def _weights(ema) -> list[dict]:
    """Clones of the weights of an EMA's tracks (one for a ModelEma)."""
    tracks = list(getattr(ema, "_tracks", (ema,)))
    return [{n: v.clone() for n, v in t.state_dict()["weights"].items()} for t in tracks]


def _copies_equal(module, copying, averaged: dict) -> bool:
    """Whether `copying` (copy_names="b") holds b's valid partitions as they are and averaged the
    rest exactly as the EMA `averaged` (weights by name) did."""
    params = dict(module.named_parameters())
    return all(
        torch.equal(v, zero3.partition(params[n]))
        if n.startswith("b.")
        else torch.equal(v, averaged[n])
        for n, v in copying.state_dict()["weights"].items()
    )


def _copied_partitions_follow(module, copying, runs_before: int) -> dict:
    """101 prepared updates of `copying`: 100 on an unchanged model, then one after b's partitions
    changed in place (put back after: the later checks use the trained model)."""
    parts = [zero3.partition(p) for p in (module.b.weight, module.b.bias)]
    saved = [t.clone() for t in parts]
    for t in parts:
        t.add_(0.5)
    copying.update(module)
    weights = copying.state_dict()["weights"]
    followed = all(torch.equal(weights[n], t) for n, t in zip(("b.weight", "b.bias"), parts))
    for t, value in zip(parts, saved):
        t.copy_(value)
    return {"runs": _prepared_runs(copying) - runs_before, "followed": followed}


def _prepared_runs(ema) -> int:
    prepared = ema._updater.prepared  # white box: whether updates take the one-call path
    return 0 if prepared is None else prepared.runs()


def _span(p) -> tuple[int, int]:
    """(start, length) of this rank's valid partition in the flattened parameter."""
    return zero3.offset(p), zero3.valid_numel(p)


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    # DeepSpeed builds a shared-memory all-reduce op at its first start (~20-50 s on 2 cores);
    # gloo does all this test needs, so it is marked unavailable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if scenario != "trainer":  # the Trainer sets up its process group itself, as in a real launch
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    rank = int(os.environ["RANK"])
    try:
        scenarios = {
            "train": train,
            "trainer": trainer,
            "accelerate_bf16": accelerate_bf16,
            "before_init": before_init,
        }
        result = scenarios[scenario](out, rank)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (out / f"{scenario}_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
