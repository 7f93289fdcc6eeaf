"""Construction styles of common model code, as small plain-PyTorch models, for the initialisation rule's corpus test.

Each style is a LightningModule (:class:`StyleModule`) whose ``configure_model()`` builds the style's model (on the meta
device under the strategy) and whose ``__init__`` may build a part for real. :func:`eager_state` is the reference: the
same module built eagerly in one process from the same seed, re-seeded between ``__init__`` and ``configure_model()``
as Lightning re-seeds every rank when its process group starts (``reset_seed``).

``ERRORS`` are the styles an eager build cannot be reproduced from, with the start of the error that names them.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from nanogpt import GPT, GPTConfig
from torch import nn
from torch.nn.init import orthogonal_ as orthogonal_by_name
from torch.nn.init import trunc_normal_ as trunc_normal_by_name

SEED = 1234
STYLES: dict[str, Callable[[], nn.Module]] = {}
# style -> a part built for real in the LightningModule's `__init__`, beside the meta-built model
REAL_PARTS: dict[str, Callable[[], nn.Module]] = {}
ERRORS = {
    "empty_never_written": "nothing its construction did wrote",
    "unwritten_bool_buffer": "nothing its construction did wrote",
    "empty_cast_to_long": "nothing its construction did wrote",
    "empty_int64_cast_to_int32": "nothing its construction did wrote",
}
# the tensor each error names
ERROR_NAMES = {
    "empty_never_written": "'w'",
    "unwritten_bool_buffer": "'mask'",
    "empty_cast_to_long": "'counts'",
    "empty_int64_cast_to_int32": "'counts'",
}
# style -> code run on the built model between `init_module(empty_init=True)` and setup (recorded until setup)
AFTER_BUILD: dict[str, Callable[[nn.Module], None]] = {}


def style(name: str) -> Callable[[Callable[[], nn.Module]], Callable[[], nn.Module]]:
    def register(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        STYLES[name] = build
        return build

    return register


# ---------------------------------------------------------------------------------------------- what already matched


# nanoGPT's model.py (tests/nanogpt.py): `self.apply(_init_weights)`, then the scaled `c_proj` loop; `wte` tied to
# `lm_head`
style("nanogpt")(lambda: GPT(GPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=8)))


@style("tied_head_first")
def _tied_head_first() -> nn.Module:
    model = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 12, bias=False))
    model[0].weight = model[1].weight
    return model


@style("orthogonal_and_trunc_normal_through_nn_init")
def _through_nn_init() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 6))
    nn.init.orthogonal_(model[0].weight)
    nn.init.trunc_normal_(model[1].weight, std=0.02)
    return model


class Copies(nn.Module):
    """Copies between parameters, and in-place writes on slices (a padding row)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.emb = nn.Embedding(6, 4)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
            self.emb.weight[0].zero_()
            self.emb.weight[2:4, 1].fill_(0.5)


style("copies_and_slices")(Copies)


class NonPersistent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)), persistent=False)


style("non_persistent_buffer")(NonPersistent)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        nn.init.kaiming_normal_(self.conv.weight, mode="fan_out", nonlinearity="relu")


style("conv_kaiming_batchnorm")(ConvNet)
style("transformer_encoder_layer")(lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0))
style("uneven_shards")(lambda: nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)))


class WithGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.w = nn.Parameter(torch.empty(5, 3))
        nn.init.normal_(self.w, generator=generator)


style("generator_argument")(WithGenerator)


# ---------------------------------------------------------------------------------------------- what the issue found


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


style("real_head_beside_meta_body")(Body)
REAL_PARTS["real_head_beside_meta_body"] = lambda: nn.Linear(4, 2)


@style("cast_sequential_to_bf16")
def _cast() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3)).to(torch.bfloat16)


class HalfInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.half()
        self.to(torch.float32)


style("self_cast_in_init")(HalfInInit)


class EmptyLikeFill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("decay", torch.empty_like(self.lin.bias).fill_(0.9))


style("empty_like_then_fill")(EmptyLikeFill)


class EmptyNeverWritten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(3, 3))  # uninitialised memory in an eager build too

    def reset_parameters(self) -> None:  # exists, but the constructor never calls it
        nn.init.ones_(self.w)


style("empty_never_written")(EmptyNeverWritten)


class Rotary(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


style("rotary_inv_freq_from_arange")(Rotary)


class ScaledLinear(nn.Linear):
    """A Linear subclass whose weight is scaled by a buffer after the Linear's own init."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, 4).unsqueeze(1))
        with torch.no_grad():
            self.weight.mul_(self.scale)


style("linear_scaled_by_buffer")(ScaledLinear)


class EMABuffer(nn.Module):
    """A buffer computed from the parameters (an EMA copy kept in the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("ema_weight", self.lin.weight.detach().clone() * 0.5)


style("buffer_computed_from_parameters")(EMABuffer)


def clones(module: nn.Module, n: int) -> nn.ModuleList:
    """The Annotated Transformer's and DETR's helper."""
    return nn.ModuleList([copy.deepcopy(module) for _ in range(n)])


class AnnotatedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = clones(nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6)), 3)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)


style("deepcopy_clones_then_xavier")(AnnotatedEncoder)


class SeededInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        torch.manual_seed(1)
        self.b = nn.Linear(4, 4)


style("manual_seed_in_init")(SeededInInit)


class ForkRng(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        with torch.random.fork_rng():
            torch.manual_seed(3)
            self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        state = torch.get_rng_state()
        self.d = nn.Linear(4, 4)
        torch.set_rng_state(state)
        self.e = nn.Linear(4, 4)


style("fork_rng_and_set_rng_state")(ForkRng)


class TimmStyle(nn.Module):
    """timm's vision transformers: ``trunc_normal_`` imported by name at import time, a class token, a position
    embedding, and the init applied over Linear layers."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, d))
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))
        self.rot = nn.Linear(d, d)
        trunc_normal_by_name(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        orthogonal_by_name(self.rot.weight)
        self.apply(self._init)

    def _init(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module is not self.rot:
            trunc_normal_by_name(module.weight, std=0.02)
            nn.init.zeros_(module.bias)


style("timm_trunc_normal_imported_by_name")(TimmStyle)


class DiscardedDraws(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.randn(5)
        self.a = nn.Linear(3, 3)
        torch.rand(2, 2)
        torch.randint(0, 10, (4,))
        torch.randperm(6)
        torch.randn_like(self.a.weight)
        torch.rand_like(self.a.bias)
        torch.bernoulli(torch.full((3,), 0.5))
        self.b = nn.Linear(3, 3)


style("discarded_random_draws")(DiscardedDraws)


class LayerScale(nn.Module):
    def __init__(self, dim: int = 6, init_values: float = 1e-5) -> None:
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))
        self.lin = nn.Linear(dim, dim)


style("layer_scale")(LayerScale)


# ---------------------------------------------------------------------------------------------- common model code


class NoGradArithmetic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        with torch.no_grad():
            self.b.weight.add_(self.a.weight * 0.5)
            self.b.bias.copy_(self.a.bias.abs() - self.b.bias)


style("no_grad_arithmetic_between_parameters")(NoGradArithmetic)


class EmptyThenLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3))
        with torch.no_grad():
            for row in range(4):
                self.w[row].normal_(std=row + 1.0)


style("empty_then_initialised_by_a_loop")(EmptyThenLoop)


class RandnTimesScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        scale = 8**-0.5
        self.proj = nn.Parameter(scale * torch.randn(8, 4))
        self.pos = nn.Parameter(torch.randn(3, 4) * 0.02)


style("parameter_from_randn_times_scale")(RandnTimesScale)


class ApplyTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.apply(self._first)
        self.apply(self._second)

    @staticmethod
    def _first(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.uniform_(module.weight, -0.1, 0.1)

    @staticmethod
    def _second(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.mul_(2.0)
                module.bias.normal_()


style("apply_twice")(ApplyTwice)
style("weight_norm_parametrization")(lambda: nn.utils.parametrizations.weight_norm(nn.Linear(4, 5)))
style("spectral_norm_parametrization")(lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(4, 5)))


@style("module_registered_after_construction")
def _registered_later() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4))
    model.add_module("extra", nn.Linear(4, 2))
    nn.init.zeros_(model.extra.bias)
    model.register_buffer("running", torch.zeros(2))
    return model


# ---------------------------------------------------------------------------------------------- the safety net


class Buffers(nn.Module):
    """A Linear beside one buffer made by ``make`` (unwritten, cast, or holding an integer dtype's extreme)."""

    def __init__(self, name: str, make: Callable[[], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer(name, make())


for _name, _buffer, _make in [
    ("unwritten_bool_buffer", "mask", lambda: torch.empty(3, dtype=torch.bool)),
    ("empty_cast_to_long", "counts", lambda: torch.empty(4).long()),
    ("empty_int64_cast_to_int32", "counts", lambda: torch.empty(4, dtype=torch.int64).to(torch.int32)),
    ("int8_127_and_uint8_255", "extremes", lambda: torch.tensor([127, -128], dtype=torch.int8)),
    ("uint8_255_filled", "extremes", lambda: torch.full((3,), 255, dtype=torch.uint8)),
    ("empty_then_fully_written_bool", "mask", lambda: torch.empty(3, dtype=torch.bool).fill_(True)),
]:
    style(_name)(functools.partial(Buffers, _buffer, _make))


# ---------------------------------------------------------------------------------------------- after the build


def litgpt_reset_parameters_overrides(model: nn.Module) -> None:
    """litgpt's pretraining ``initialize_weights``: each module's ``reset_parameters`` overridden on the instance with
    the GPT-NeoX init, then all called (``litgpt.utils.reset_parameters``)."""

    def init_weights(module: nn.Module, std: float) -> None:
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)

    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.Linear)):
            module.reset_parameters = functools.partial(init_weights, module, std=math.sqrt(2.0 / 5 / 8))
    for module in model.modules():
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()


def apply_init(model: nn.Module) -> None:
    def init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.5)

    model.apply(init)


def generator_used_again(model: nn.Module) -> None:
    """A ``generator=`` used in the build (``WithGenerator``) is used again before setup."""
    torch.randn(3, generator=model.generator)


for _name, _after in {
    "litgpt_reset_parameters_overrides": litgpt_reset_parameters_overrides,
    "model_apply_init_after_build": apply_init,
}.items():
    style(_name)(lambda: nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8)))
    AFTER_BUILD[_name] = _after


class ReusedGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(7)
        self.w = nn.Parameter(torch.empty(5, 3))
        nn.init.normal_(self.w, generator=self.generator)


style("generator_used_again_before_setup")(ReusedGenerator)
AFTER_BUILD["generator_used_again_before_setup"] = generator_used_again


class DrawnOnRealDevice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.noise = nn.Parameter(torch.randn(3, device="cpu") * 0.1)


style("drawn_on_a_real_device")(DrawnOnRealDevice)


# ---------------------------------------------------------------------------------------------- the harness


class StyleModule(L.LightningModule):
    """``model`` built in ``configure_model()`` by the style; ``head`` built for real in ``__init__`` where the style
    has a real part."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.model: nn.Module | None = None
        self.head = REAL_PARTS[name]() if name in REAL_PARTS else None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = STYLES[self.name]()
            AFTER_BUILD.get(self.name, lambda model: None)(self.model)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return sum(p.sum() for p in self.parameters())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def eager_state(name: str) -> dict[str, torch.Tensor]:
    """The reference: the style's module built eagerly in one process, as the Trainer seeds it."""
    torch.manual_seed(SEED)
    module = StyleModule(name)
    torch.manual_seed(SEED)  # Lightning's reset_seed() when the process group starts
    module.configure_model()
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def eager_after_build(name: str, seed: int = SEED) -> dict[str, Any]:
    """The reference for Fabric's ``init_module(empty_init=True)``, the code after it, a real head assigned before
    setup and a draw after setup (``init_corpus_run.fabric_after_build``), run eagerly in one process."""
    torch.manual_seed(seed)
    model = STYLES[name]()
    AFTER_BUILD.get(name, lambda model: None)(model)
    model.head = nn.Linear(4, 2)
    state = {key: value.detach().clone() for key, value in model.state_dict().items()}
    return {"state": state, "drawn": torch.rand(4)}
