"""Frozen parameters in the memory estimate: the formula against hand-computed figures and against the simulation,
``lightning-shard estimate``'s LoRA options, and ``sharding_strategy="auto"`` for a LoRA run. Transformers models
simulated (a tiny Llama from pretrained files through the example's module, with and without ``--lora-rank``, and
from its config) against the formula: parameters and AdamW states equal but for buffers and step counters.

The LoRA models are peft's: adapters put on a model by ``inject_adapter_in_model``, which freezes everything else as
``get_peft_model`` does.
"""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_shard.memory import choose_sharding, estimate_main, estimate_memory
from lightning_shard.memory.units import count_parameters

peft = pytest.importorskip("peft", reason="peft is not installed")

MIB = 2**20
WIDTH, DEPTH, RANK = 1000, 4, 8
FROZEN = DEPTH * (WIDTH * WIDTH + WIDTH)  # 4,004,000 base weights and biases
ADAPTERS = DEPTH * RANK * 2 * WIDTH  # lora_A (8 x 1000) + lora_B (1000 x 8) per layer: 64,000


def _layers(lora: bool) -> nn.Sequential:
    """Four 1000-wide Linear blocks; with ``lora`` peft's rank-8 adapters on each and the base frozen."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
        if lora:
            config = peft.LoraConfig(r=RANK, target_modules=[str(i) for i in range(DEPTH)])
            model = peft.inject_adapter_in_model(config, model)
    return model


def test_frozen_parameters_cost_their_stored_copy_only() -> None:
    model = _layers(lora=True)
    assert count_parameters(model) == (FROZEN + ADAPTERS, FROZEN // DEPTH + ADAPTERS // DEPTH, ADAPTERS, 16_000)
    estimate = estimate_memory(model, world_size=2, precision="bf16-mixed")
    assert (estimate.n_params, estimate.trainable_params) == (FROZEN + ADAPTERS, ADAPTERS)
    device = estimate.device
    # fp32 shards of every parameter; fp32 gradients and two AdamW states of the adapters only; over 2 ranks
    assert device.params == (FROZEN + ADAPTERS) * 4 // 2 == 8_136_000
    assert device.grads == ADAPTERS * 4 // 2 == 128_000
    assert device.optimizer_states == ADAPTERS * 8 // 2 == 256_000
    # three gathered blocks in bf16 (frozen weights are gathered too) + the largest reduce-scatter: one block's
    # adapter gradients in fp32
    assert device.gathered_peak == 3 * 1_017_000 * 2 + 16_000 * 4 == 6_166_000
    # the full fine-tune of the same weights: 16 bytes per parameter
    full = estimate_memory(_layers(lora=False), world_size=2, precision="bf16-mixed")
    assert full.device.params + full.device.grads + full.device.optimizer_states == 16 * FROZEN // 2
    # whole gradients kept between micro-batches: the adapters' only
    unsharded = estimate_memory(
        model, world_size=2, precision="bf16-mixed", accumulate_grad_batches=4, gradient_accumulation="unsharded"
    )
    assert unsharded.device.accumulated_grads == ADAPTERS * 4 and unsharded.device.grads == 0


def test_a_parameter_count_takes_the_trainable_count() -> None:
    # 13.1e9 parameters, 0.1% trained, 8 ranks, bf16-mixed: (4 x 13.1e9 + 12 x 13.1e6) / 8 bytes, as the docstring
    lora = estimate_memory(13_100_000_000, trainable_params=13_100_000, world_size=8, precision="bf16-mixed")
    per_rank = lora.per_rank
    assert (per_rank.params, per_rank.grads, per_rank.optimizer_states) == (6_550_000_000, 6_550_000, 13_100_000)
    # the whole model is one unit when nothing says otherwise; it trains the model's fraction
    assert per_rank.gathered_peak == 3 * 13_100_000_000 * 2 + 13_100_000 * 4
    assert estimate_memory(1000, largest_unit_params=100, trainable_params=10).device.gathered_peak == 3 * 400 + 4
    with pytest.raises(ValueError, match="trainable_params must be between 0 and the 1,000 parameters, got 1,001"):
        estimate_memory(1000, trainable_params=1001)
    with pytest.raises(ValueError, match="a module says which parameters train by their requires_grad"):
        estimate_memory(nn.Linear(2, 2), trainable_params=1)


def test_auto_sharding_shards_a_lora_run_less_than_its_full_fine_tune() -> None:
    # 48 MiB per rank, 70% budget 33.6 MiB, 2 ranks, fp32, no offload. The full fine-tune needs 45.8 MiB even under
    # FULL_SHARD; with the base frozen, NO_SHARD needs 31.8 MiB (15.5 stored + 15.5 gathered + 0.7 adapter states).
    settings = {"world_size": 2, "precision": "32-true", "activation_checkpointing": False, "can_offload": False}
    with pytest.raises(MemoryError, match=r"FULL_SHARD 45\.8 MiB"):
        choose_sharding(_layers(lora=False), **settings, device_memory_bytes=48 * MIB)
    choice = choose_sharding(_layers(lora=True), **settings, device_memory_bytes=48 * MIB)
    assert (choice.sharding_strategy, choice.cpu_offload) == ("NO_SHARD", False)
    assert "4,068,000 parameters, 4,004,000 of them frozen" in choice.reason and "NO_SHARD 31.8 MiB" in choice.reason


def _gpt_config(tmp_path: Path) -> Path:
    config = tmp_path / "gpt.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n  precision: bf16-mixed\n"
        "model:\n  class_path: examples.gpt.model.GPT\n"
        "  init_args: {n_layer: 2, n_head: 4, n_embd: 128, vocab_size: 512, block_size: 64}\n"
        "data:\n  batch_size: 4\n"
    )
    return config


def test_lora_options_of_the_estimate_cli_match_the_simulation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The example GPT with rank-8 adapters on every `qkv` and `proj` Linear (attention 128->384 and 128->128, MLP
    # 512->128), trained two steps under fake tensors on 2 simulated ranks against the formula.
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the model class is imported from examples/
    lora = ["--lora-rank", "8", "--lora-targets", "qkv,proj"]
    assert estimate_main(["--config", str(_gpt_config(tmp_path)), "--mode", "simulate", "--json", *lora]) == 0
    payload = json.loads(capsys.readouterr().out)
    adapters = 2 * 8 * ((128 + 384) + (128 + 128) + (512 + 128))
    assert payload["trainable_params"] == payload["simulated"]["trainable_params"] == adapters == 22_528
    formula, simulated = payload["formula"]["device"], payload["simulated"]["device"]
    assert formula["grads"] == adapters * 4 // 2 and formula["optimizer_states"] == adapters * 8 // 2
    assert simulated["params"] == formula["params"] == payload["n_params"] * 4 // 2
    # AdamW's states for the adapters only (the simulation adds its 4-byte step counters: within 0.1%)
    assert simulated["optimizer_states"] == pytest.approx(formula["optimizer_states"], rel=1e-3)
    # the formula adds every activation, three gathered blocks and the gradients at once: an upper bound
    model_states = formula["params"] + formula["optimizer_states"]
    assert model_states < simulated["total_bytes"] <= formula["total_bytes"]


def test_trainable_parameters_option_and_its_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    config = _gpt_config(tmp_path)
    assert estimate_main(["--config", str(config), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    args = ["--config", str(config), "--json", "--trainable-parameters", "1000"]
    assert estimate_main(args) == 0
    counted = json.loads(capsys.readouterr().out)
    assert (counted["n_params"], counted["trainable_params"]) == (full["n_params"], 1000)
    assert counted["device"]["params"] == full["device"]["params"]
    assert (counted["device"]["grads"], counted["device"]["optimizer_states"]) == (2000, 4000)
    for bad, message in (
        (["--lora-rank", "8"], "--lora-rank and --lora-targets go together"),
        (["--lora-rank", "8", "--lora-targets", "qkv", "--trainable-parameters", "5"], "not both"),
        (["--trainable-parameters", "5", "--mode", "simulate"], "--trainable-parameters is a count"),
        (["--lora-rank", "8", "--lora-targets", "q_proj"], "q_proj"),  # peft: no module of that name
    ):
        assert estimate_main(["--config", str(config), *bad]) == 2, bad
        assert message in capsys.readouterr().err, bad


# ---------------------------------------------------------------------------------------------- transformers models


def _tiny_llama() -> nn.Module:
    """A tiny transformers Llama from its config (``tests/hf_run.py``'s): the simulation's model function."""
    from hf_run import llama_config
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(llama_config())


def _check_against_formula(formula: dict, simulated: dict, model: nn.Module) -> None:
    """The simulated peak of one rank of 2 against the formula, for a module ``model`` (on the meta device)."""
    buffers = sum(buffer.numel() * buffer.element_size() for buffer in model.buffers())
    trainable_tensors = sum(1 for param in model.parameters() if param.requires_grad)
    # every parameter's fp32 shard (all dims even: no padding); the simulation also counts the buffers (rotary
    # inv_freq), whole on every rank
    assert simulated["params"] == formula["params"] + buffers
    # AdamW's two fp32 states of the trainable parameters only; the simulation also counts a 4-byte step per tensor
    assert simulated["optimizer_states"] == formula["optimizer_states"] + 4 * trainable_tensors
    # The formula's three gathered fp32 units (root, computing, next) and one reduce-scatter input; at a peak while
    # one unit computes, the simulation also holds the all-gather buffers of it and of the next unit (measured here:
    # 0.61 of the formula's for the full fine-tune, 1.12 with LoRA, whose reduce-scatter input is small): at most one
    # unit more.
    unit = 4 * count_parameters(model).largest_unit
    ratio = simulated["gathered_peak"] / formula["gathered_peak"]
    print(f"gathered: simulated {simulated['gathered_peak']:,} B, formula {formula['gathered_peak']:,} B ({ratio:.2f})")
    assert 0 < simulated["gathered_peak"] <= formula["gathered_peak"] + unit
    # the formula counts activations from the GPT dims of the model section, which a transformers model's has not
    assert formula["activations"] == 0 < simulated["activations"]


@pytest.mark.parametrize("lora", [False, True])
def test_a_pretrained_transformers_model_simulates_with_and_without_lora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    # The example's HFCausalLM on a tiny Llama's save_pretrained files (lightning_shard.hf.from_pretrained on the
    # meta device: nothing is read under fake tensors), vocab_size from its config, seq-len from data.block_size.
    from hf_run import llama_config
    from transformers import AutoModelForCausalLM

    from examples.hf.model import HFCausalLM
    from lightning_shard.memory.estimate_cli import _build_on_meta

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    AutoModelForCausalLM.from_config(llama_config()).save_pretrained(tmp_path / "llama")
    config = tmp_path / "llama.yaml"
    config.write_text(
        "trainer:\n  devices: 2\n"
        f"model:\n  class_path: examples.hf.model.HFCausalLM\n  init_args: {{pretrained_path: {tmp_path / 'llama'}}}\n"
        "data:\n  batch_size: 2\n  block_size: 16\n"
    )
    options = ["--lora-rank", str(RANK), "--lora-targets", "q_proj,v_proj"] if lora else []
    assert estimate_main(["--config", str(config), "--mode", "simulate", "--json", *options]) == 0
    payload = json.loads(capsys.readouterr().out)
    model = _build_on_meta(
        HFCausalLM, {"pretrained_path": str(tmp_path / "llama")}, (RANK, ["q_proj", "v_proj"]) if lora else None
    )
    # rank-8 adapters on q (64 -> 64) and v (64 -> 2 heads x 16) of 2 layers
    adapters = 2 * RANK * ((64 + 64) + (64 + 32))
    assert payload["n_params"] == count_parameters(model).total == payload["simulated"]["n_params"]
    trainable = adapters if lora else payload["n_params"]
    assert payload["trainable_params"] == payload["simulated"]["trainable_params"] == trainable
    _check_against_formula(payload["formula"]["device"], payload["simulated"]["device"], model)


def test_a_transformers_model_from_its_config_simulates() -> None:
    # Built on the meta device from a config: transformers' init runs on fake tensors, where the check for tensors it
    # leaves unset (NaN-filled) has no values to read and is skipped.
    from functools import partial

    from hf_run import VOCAB

    with torch.device("meta"):
        model = _tiny_llama()
    settings = {"world_size": 2, "micro_batch_size": 2, "seq_len": 16}
    simulated = estimate_memory(
        _tiny_llama, mode="simulate", input_fn=partial(torch.randint, 0, VOCAB, (2, 16)), **settings
    )
    formula = estimate_memory(model, **settings)
    assert simulated.trainable_params == formula.trainable_params == simulated.n_params == formula.n_params
    _check_against_formula(formula.device.to_dict(), simulated.device.to_dict(), model)
