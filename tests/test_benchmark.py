"""The benchmark's machinery, not its speed (speed is never asserted in a unit test): the main
job runs end to end and writes its JSON, table and chart; a contender that computes the wrong
thing is caught by the correctness check and not timed."""

import json
import sys

import pytest
import torch

import fused_ema
from benchmarks import bench, contenders, models


def test_main_job_writes_json_table_and_chart(tmp_path):
    record = bench.main(
        [
            "--scenarios",
            "resnet50",
            "--devices",
            "cpu",
            "--rounds",
            "1",
            "--reps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md", ".png"]
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["machine"]["cpu"] and saved["machine"]["torch"] == torch.__version__
    (scenario,) = record["scenarios"]
    status = {c["name"]: c["status"] for c in scenario["contenders"]}
    assert status["fused_ema.lerp_"] == "ok" and status["torch._foreach_lerp_"] == "ok"
    fused = next(c for c in scenario["contenders"] if c["name"] == "fused_ema.lerp_")
    assert fused["median_ms"] > 0 and fused["vs_foreach"] > 0 and fused["pct_copy_bw"] > 0


class WrongDecay(contenders.ForeachLerp):
    name = "wrong decay"

    def step(self):
        torch._foreach_lerp_(self.ema_list, self.src, 0.5)


class WrongDtype(contenders.ForeachLerp):
    name = "bf16 EMA"

    def __init__(self, model, decay, ema_dtype, ema_device):
        super().__init__(model, decay, torch.bfloat16, ema_device)
        self.ema_dtype = ema_dtype


def test_correctness_check_rejects_contenders_that_compute_something_else():
    model = models.randomize_(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    right = contenders.FusedOp(model, 0.999, torch.float32, None)
    right.prime()
    assert bench.check(right, model, seed=1) is None
    for cls, message in ((WrongDecay, "off by"), (WrongDtype, "keeps a bfloat16 EMA")):
        contender = cls(model, 0.999, torch.float32, None)
        contender.prime()
        assert message in bench.check(contender, model, seed=2)


def test_gpu_scenarios_are_defined_and_refused_without_a_gpu():
    gpu_only = [s.name for s in bench.SCENARIOS if s.gpu_only]
    assert gpu_only == ["cpu_ema_of_cuda_model"]
    if not torch.cuda.is_available():
        try:
            bench.main(["--devices", "cuda"])
        except SystemExit as exit_:
            assert exit_.code != 0
        else:
            raise AssertionError("--devices cuda ran without a GPU")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenarios", "many-small"], "unknown --scenarios ['many-small']"),
        (["--scenarios", ","], "unknown --scenarios []"),
        (["--devices", "tpu"], "--devices 'tpu'"),
        (["--scenarios", "cpu_ema_of_cuda_model", "--devices", "cpu"], "GPU-only"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_any_run(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main([*argv, "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_training_loop_benchmark_runs(tmp_path):
    from benchmarks import training_loop

    record = training_loop.main(
        [
            "--device",
            "cpu",
            "--width",
            "32",
            "--depth",
            "2",
            "--batch",
            "8",
            "--rounds",
            "1",
            "--reps",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    variants = record["variants"]
    assert variants["no EMA"]["vs_no_ema"] == 1.0
    assert variants["EMA on the model's device"]["median_ms"] > 0
    assert list(tmp_path.glob("training_loop_*.json"))


def test_overhead_benchmark_runs(tmp_path):
    from benchmarks import overhead

    record = overhead.main(
        ["--sizes", "8,40", "--rounds", "1", "--reps", "1", "--out", str(tmp_path)]
    )
    assert [row["tensors"] for row in record["rows"]] == [8, 40]
    # Before 3.12 there is no walk cache: its check is n/a there, with why; the rest is measured.
    missing = {overhead.CACHED_CHECK} if sys.version_info < (3, 12) else set()
    for row in record["rows"]:
        for name in overhead.CONTENDERS:
            if name in missing:
                assert row[name]["status"].startswith("n/a: no walk cache on Python 3.")
                assert "ns_per_tensor" not in row[name]
            else:
                assert row[name]["status"] == "ok" and row[name]["ns_per_tensor"] > 0, name
    assert sorted(p.suffix for p in tmp_path.glob("overhead_*")) == [".json", ".md"]
    written = next(tmp_path.glob("overhead_*.md")).read_text()
    assert all(f"{name}: n/a: no walk cache" in written for name in missing)


def test_stochastic_benchmark_runs_at_tiny_size(tmp_path):
    from benchmarks import stochastic

    args = ["--pairs", "bf16/bf16,f32/bf16", "--rounds", "1", "--dim", "16", "--timm"]
    record = stochastic.main([*args, "--out", str(tmp_path)])
    isas = [i for i in ("avx512", "avx2") if i in fused_ema.build_info()["cpu_isas_available"]]
    assert len(record["rows"]) == 3 * 2 * len(isas)
    for row in record["rows"]:
        assert row["nearest"]["median_ms"] > 0 and row["ratio"] > 0, row
    assert sorted(p.suffix for p in tmp_path.glob("stochastic_*")) == [".json", ".md"]


def test_posthoc_benchmark_runs_at_tiny_size(tmp_path):
    from benchmarks import posthoc

    args = ["--ks", "1,2", "--rounds", "1", "--scale", "0.001", "--snapshot-steps", "3"]
    args += ["--snapshot-blocks", "2", "--out", str(tmp_path)]
    record = posthoc.main(args)
    assert [(r["shape"], r["k"]) for r in record["updates"]] == [
        ("large", 1),
        ("large", 2),
        ("small", 1),
        ("small", 2),
    ]
    for row in record["updates"]:
        for name in ("lerp_many_", "K x lerp_", "PostHocEma.update"):
            assert row[name]["median_ms"] > 0, name
    assert record["snapshots"]["no snapshots"]["median_ms"] > 0
    assert sorted(p.suffix for p in tmp_path.glob("posthoc_*")) == [".json", ".md", ".png"]


def test_accuracy_benchmark_runs_at_tiny_size(tmp_path):
    from benchmarks import accuracy, peers

    record = accuracy.main(
        [
            "--steps", "40",
            "--elements", "3000",
            "--mlp-width", "16",
            "--replicas", "4",
            "--replica-elements", "256",
            "--stall-window", "20",
            "--points", "10",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json", ".md", ".png"]
    assert all(p.name.startswith("accuracy_") for p in tmp_path.iterdir())
    assert [c["case"] for c in record["cases"]] == ["drift", "mlp"]
    for case in record["cases"]:
        assert [d["decay"] for d in case["decays"]] == [0.999, 0.9999]
        for entry in case["decays"]:
            rows = entry["methods"]
            fp32, nearest = rows[accuracy.FP32], rows[accuracy.NEAREST]
            # a float32 EMA is exact to float32 rounding; bf16 round-to-nearest is far off
            assert fp32["rel_rms"] < 1e-5 < nearest["rel_rms"]
            assert 0 <= nearest["stalled_fraction"] <= 1 and fp32["stalled_fraction"] == 0
            assert len(fp32["curve"]) >= 10
            for method, reason in (
                (accuracy.FUSED_SR, peers.fused_stochastic_missing()),
                (accuracy.TIMM_SR, peers.timm_missing(stochastic_rounding=True)),
            ):
                row = rows[method]
                if reason:  # the stochastic rows say why they are missing, never pass silently
                    assert reason in row["status"]
                else:
                    assert row["status"] == "ok" and row["replicas"] == 4
                    assert row["replica_elements"] == 256 and "replica_bias_ulp" in row
    if peers.fused_stochastic_missing():
        assert "pending" in (tmp_path / next(tmp_path.glob("*.md")).name).read_text()


def test_stochastic_contenders_skip_until_their_api_exists():
    from benchmarks import peers

    status = {
        contenders.FusedStochastic: peers.fused_stochastic_missing(),
        contenders.ModelEmaStochastic: peers.model_ema_stochastic_missing(),
        contenders.TimmModelEmaV3Stochastic: peers.timm_missing(stochastic_rounding=True),
    }
    for cls, reason in status.items():
        assert cls.stochastic_rounding
        if reason:
            assert reason in cls.unavailable()
        else:
            assert cls.unavailable() is None
        assert cls.applies(None, torch.float32).startswith("n/a")


def test_stochastic_check_rejects_round_to_nearest():
    model = models.randomize_(torch.nn.Sequential(torch.nn.Linear(512, 512)))
    model.to(torch.bfloat16)

    class NearestPosingAsStochastic(contenders.FusedOp):
        name = "nearest"
        stochastic_rounding = True

    contender = NearestPosingAsStochastic(model, 0.999, torch.bfloat16, None)
    contender.prime()
    assert "not stochastic rounding" in bench.check(contender, model, seed=3)


def test_timm_contender_is_the_real_class_and_checked():
    from benchmarks import peers

    reason = peers.timm_missing()
    if reason:
        pytest.skip(reason)
    model = models.randomize_(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    timm = contenders.TimmModelEmaV3(model, 0.999, torch.float32, None)
    assert type(timm.averager) is peers.load_timm_model_ema().ModelEmaV3
    timm.prime()
    assert bench.check(timm, model, seed=1) is None
    # timm pairs state_dict entries by position: a tied weight is averaged twice a step
    tied = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False))
    tied[1].weight = tied[0].weight
    models.randomize_(tied)
    contender = contenders.TimmModelEmaV3(tied, 0.999, torch.float32, None)
    contender.prime()
    assert bench.check(contender, tied, seed=2).startswith("wrong")
    assert "twice a step" in contender.note


def test_profile_of_one_update_is_written(tmp_path):
    import gzip
    import json

    from benchmarks import profile_update

    trace = profile_update.main(["--device", "cpu", "--out", str(tmp_path)])
    with gzip.open(trace) as packed:
        events = json.load(packed)["traceEvents"]
    names = {event.get("name") for event in events}
    assert "ModelEma.update" in names and "fused_ema::lerp_" in names, sorted(map(str, names))[:40]
    table = next(tmp_path.glob("profile_update_vit_b16_*.txt")).read_text()
    assert "ModelEma.update" in table


def test_bema_benchmark_runs_at_small_scale(tmp_path):
    """benchmarks/bema.py on a tiny GPT-2: every contender that can run is checked against the
    reference and timed; one that cannot (TRL not installed, fused_ema.Bema not built yet) says
    why in the record and the table instead of passing silently."""
    pytest.importorskip("transformers", reason="benchmarks/bema.py builds a transformers GPT-2")
    from benchmarks import bema, peers

    args = ["--scale", "small", "--rounds", "2", "--reps", "1", "--warmup", "1"]
    args += ["--out", str(tmp_path)]
    record = bema.main(args)
    result = record["result"]
    assert result["parameters"] > 0 and result["tensors"] > 0
    statuses = {name: c["status"] for name, c in result["contenders"].items()}
    reasons = {bema.FUSED: bema.bema_missing(), bema.FOREACH: None, bema.FLOOR: None}
    try:
        peers.load_trl_bema_callback()
        reasons[bema.TRL] = None
    except peers.PeerUnavailable as err:
        reasons[bema.TRL] = str(err)
    assert sorted(statuses) == sorted(reasons)
    for name, reason in reasons.items():
        if reason:
            assert statuses[name] == f"n/a: {reason}", name
        else:
            assert statuses[name] == "ok", (name, statuses[name])
            assert result["contenders"][name]["median_ms"] > 0
    for name, error in result["max_rel_error"].items():
        assert error <= bema.TOLERANCE, (name, error)
    assert bema.FLOOR not in result["max_rel_error"]  # its own data: nothing to compare
    floor = result["floor"]
    assert floor["pass_bytes"] == 20 * result["parameters"] and floor["copy_gb_s"] > 0
    for c in result["contenders"].values():
        if c["status"] == "ok":
            assert c["gb_s"] == pytest.approx(floor["pass_bytes"] / c["median_ms"] / 1e6)
    assert sorted(p.suffix for p in tmp_path.glob("bema_*")) == [".json", ".md"]
    table = next(tmp_path.glob("bema_*.md")).read_text()
    for name, reason in reasons.items():
        assert name in table and (reason is None or reason in table)


def test_bema_benchmark_checks_trl_and_rejects_a_wrong_contender(tmp_path):
    """With TRL installed, TRL's own BEMACallback is the reference the other contenders are held
    to, and a contender computing another alpha is caught before it is timed."""
    pytest.importorskip("transformers", reason="benchmarks/bema.py builds a transformers GPT-2")
    from benchmarks import bema
    from trl_reference import trl_bema_callback

    cls = trl_bema_callback()
    model = bema.build_model("small")
    trl = bema.TrlContender(model, tmp_path, "cpu")
    assert type(trl.callback) is cls

    class WrongAlpha(bema.ForeachContender):
        def _update(self, step):
            super()._update(step + 5)

    made = {bema.TRL: trl, bema.FOREACH: bema.ForeachContender(model), "wrong": WrongAlpha(model)}
    errors = bema.check(made, bema.Perturber(model))
    assert errors[bema.FOREACH] <= bema.TOLERANCE < errors["wrong"]
