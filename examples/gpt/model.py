"""A GPT-3 style decoder (the fairseq/metaseq "dense" models) as a LightningModule, nanoGPT style.

Pre-LayerNorm blocks, learned token and position embeddings, biases everywhere, GELU MLP, and an output projection
tied to the token embedding. Layers are created in ``configure_model()`` so the Trainer can build them on the meta
device, and every initialisation lives in a module's ``reset_parameters()``: that is what a sharding strategy calls
to materialise a meta-device model, so a model initialised any other way would come out different when sharded.

Sizes of the fairseq GPT-3 family (context 2048, vocabulary 50272) are in :data:`GPT3_SIZES`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from examples.causal_lm import CausalLM

# name: (n_layer, n_embd, n_head), as in fairseq's GPT-3 model sizes. With this model (tied output projection,
# 2048 learned positions, biases) "13b" has 12,853,463,040 parameters. fairseq logs 13,110,865,920 for it: that
# figure counts the output projection as its own 50272 x 5120 matrix and has 2 more positions (its padding offset).
GPT3_SIZES = {
    "small": (12, 768, 12),
    "medium": (24, 1024, 16),
    "large": (24, 1536, 16),
    "xl": (24, 2048, 32),
    "2.7b": (32, 2560, 32),
    "6.7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
}


class Linear(nn.Linear):
    """``nn.Linear`` initialised N(0, std) with zero bias (GPT-2/3 init) in ``reset_parameters()``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02) -> None:
        self.std = std  # set first: nn.Linear.__init__ calls reset_parameters()
        super().__init__(in_features, out_features, bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` initialised N(0, 0.02) in ``reset_parameters()``."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused qkv projection.

    The projection's output features are grouped by head - head 0's query, key and value, then head 1's, ... (Megatron's
    layout) - and the forward counts heads from the features it gets (``-1``), so under tensor parallelism the
    projection splits column-wise into whole heads per rank and the same code computes this rank's heads.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool, proj_std: float) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.head_dim = n_embd // n_head
        self.dropout = dropout
        self.qkv = Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = Linear(n_embd, n_embd, bias=bias, std=proj_std)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        # (B, T, heads x 3 x head_dim) -> three (B, heads, T, head_dim)
        qkv = self.qkv(x).view(batch, time, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, time, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Linear(d, 4d) -> GELU -> Linear(4d, d)."""

    def __init__(self, n_embd: int, dropout: float, bias: bool, proj_std: float) -> None:
        super().__init__()
        self.fc = Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.proj = Linear(4 * n_embd, n_embd, bias=bias, std=proj_std)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer decoder block: the unit to shard and to activation-checkpoint."""

    def __init__(self, n_embd: int, n_head: int, n_layer: int, dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        # GPT-2: shrink the init of projections that write into the residual stream by 1/sqrt(2 * n_layer),
        # so the stream's variance does not grow with depth.
        proj_std = 0.02 / math.sqrt(2 * n_layer)
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias, proj_std)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias, proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    """GPT-3 style language model.

    Example:
        >>> model = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=16)
        >>> model.configure_model()
        >>> model(torch.zeros(1, 16, dtype=torch.long)).shape
        torch.Size([1, 16, 256])
    """

    def __init__(
        self,
        n_layer: int = 12,
        n_head: int = 12,
        n_embd: int = 768,
        vocab_size: int = 50272,
        block_size: int = 2048,
        dropout: float = 0.0,
        bias: bool = True,
        learning_rate: float = 6e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 375,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        """
        Args:
            n_layer, n_head, n_embd: depth, attention heads, width.
            vocab_size: token vocabulary (256 for the byte-level data).
            block_size: context length; also the number of learned positions.
            dropout: dropout probability on attention weights and residual branches.
            bias: biases in Linear and LayerNorm layers.
            learning_rate: peak AdamW learning rate.
            weight_decay: AdamW weight decay for matrices (not biases, LayerNorms or embeddings).
            betas: AdamW betas.
            warmup_steps: linear warm-up steps.
            max_steps: end of the cosine decay; ``None`` uses the Trainer's estimated total steps.
            min_lr_ratio: final learning rate as a fraction of the peak.
        """
        super().__init__()
        self.save_hyperparameters()
        self.transformer: nn.ModuleDict | None = None
        # Metrics are created here, not in configure_model(), so they exist on a real device from the start.
        self.val_loss = torchmetrics.aggregation.MeanMetric()

    def configure_model(self) -> None:
        # Lightning may call this more than once (e.g. fit, then validate): build only once.
        if self.transformer is not None:
            return
        hp = self.hparams
        # Modules are constructed in the order they are registered (= `modules()` order), so an eager build and a
        # meta-device build materialised module by module draw their random init in the same sequence.
        self.transformer = nn.ModuleDict()
        self.transformer["wte"] = Embedding(hp.vocab_size, hp.n_embd)
        self.transformer["wpe"] = Embedding(hp.block_size, hp.n_embd)
        self.transformer["drop"] = nn.Dropout(hp.dropout)
        self.transformer["h"] = nn.ModuleList(
            Block(hp.n_embd, hp.n_head, hp.n_layer, hp.dropout, hp.bias) for _ in range(hp.n_layer)
        )
        self.transformer["ln_f"] = nn.LayerNorm(hp.n_embd, bias=hp.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> next-token logits ``(B, T, vocab_size)``."""
        time = idx.shape[1]
        if time > self.hparams.block_size:
            raise ValueError(f"Sequence length {time} exceeds block_size {self.hparams.block_size}")
        tr = self.transformer
        positions = torch.arange(time, device=idx.device)
        x = tr.drop(tr.wte(idx) + tr.wpe(positions))
        for block in tr.h:
            x = block(x)
        # Output projection tied to the token embedding: one (vocab, n_embd) parameter, no separate lm_head. Under
        # tensor parallelism that weight's vocabulary rows are split over the tensor-parallel ranks (a DTensor): each
        # rank computes its part of the vocabulary's logits, then all are gathered for the loss.
        x, weight = tr.ln_f(x), tr.wte.weight
        if isinstance(weight, DTensor):
            return F.linear(
                DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False), weight
            ).full_tensor()
        return F.linear(x, weight)

    def tensor_parallel_plan(self, size: int) -> dict[str, str]:
        """What ``ShardedStrategy(tensor_parallel_size=size)`` splits (``tensor_parallel_plan="auto"``): each block's
        attention heads and MLP hidden units (Megatron's pair: the layer into them column-wise, the layer out of them
        row-wise, one all-reduce each in forward and backward), and the vocabulary of the tied embedding.

        Example:
            >>> model = GPT(n_layer=1, n_head=4, n_embd=8, vocab_size=256, block_size=8)
            >>> model.tensor_parallel_plan(2)["transformer.wte"]
            'rowwise'
        """
        if self.hparams.n_head % size:
            raise ValueError(
                f"`tensor_parallel_size={size}` does not divide the GPT's n_head={self.hparams.n_head}: each rank "
                "computes whole attention heads. Choose a divisor of n_head."
            )
        return {
            "transformer.wte": "rowwise",
            "transformer.h.*.attn.qkv": "colwise",
            "transformer.h.*.attn.proj": "rowwise",
            "transformer.h.*.mlp.fc": "colwise",
            "transformer.h.*.mlp.proj": "rowwise",
        }

    def configure_optimizers(self) -> dict[str, Any]:
        # Decay only the weight matrices; biases, LayerNorm and embedding tables are left alone.
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (decay if param.dim() >= 2 and "wte" not in name and "wpe" not in name else no_decay).append(param)
        return self.adamw_warmup_cosine(decay, no_decay, betas=tuple(self.hparams.betas))

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Extend ``idx`` ``(B, T)`` by ``max_new_tokens`` sampled tokens.

        Example:
            >>> model = GPT(n_layer=1, n_head=1, n_embd=8, vocab_size=256, block_size=8)
            >>> model.configure_model()
            >>> model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=10, top_k=5).shape
            torch.Size([1, 13])
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.hparams.block_size :]
            logits = self(context)[:, -1, :] / temperature
            if top_k is not None:
                kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once).

    Example:
        >>> model = GPT(n_layer=1, n_head=1, n_embd=8, vocab_size=16, block_size=4)
        >>> model.configure_model()
        >>> count_parameters(model)
        1048
    """
    return sum(p.numel() for p in model.parameters())
