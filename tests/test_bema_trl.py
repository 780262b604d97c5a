"""fused_ema.Bema against TRL's own BEMACallback (trl 1.16.0) on a real transformers model over a
training run, driven through TRL's callback hooks: the same corrected weights (fp32, within 1e-5
relative), with TRL's meaning of every argument. Skipped, with the import error, where TRL cannot
be installed beside this torch."""

import pytest
import torch

from trl_reference import trl_bema_callback

transformers = pytest.importorskip("transformers")

from fused_ema import Bema  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize(
    "options",
    [
        {"update_freq": 1},
        {"update_freq": 2, "update_after": 3},
        {
            "update_freq": 3,
            "update_after": 2,
            "lag": 1,
            "multiplier": 0.5,
            "ema_power": 0.8,
            "bias_power": 0.4,
            "min_ema_multiplier": 0.3,
        },  # fmt: skip
    ],
    ids=["every-step", "after-3", "all-arguments"],
)
def test_the_same_corrected_weights_as_trls_callback(tmp_path, options):
    TrlBema = trl_bema_callback()
    model = gpt2()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state, control = transformers.TrainerState(), transformers.TrainerControl()
    trl = TrlBema(**options, device="cpu")
    trl.on_train_begin(args, state, control, model=model)
    ours = Bema(model, **options, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for step in range(1, 16):
        ids = torch.randint(0, 97, (4, 16), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.global_step = step
        trl.on_step_end(args, state, control, model=model)
        ours.update(model, step=step)
    theirs = dict(trl.running_model.named_parameters())
    mine = dict(ours.module.named_parameters())
    assert theirs.keys() == mine.keys()
    for name, value in theirs.items():
        scale = value.abs().max().clamp_min(1e-6)
        error = float((mine[name].detach() - value.detach()).abs().max() / scale)
        assert error < 1e-5, f"{name}: {error}"
