"""What a GPT-shaped transformer costs, from its dimensions alone: its parameter count and largest block
(:func:`gpt_parameter_count`), and the activation bytes of one micro-batch (:func:`activation_bytes`, Korthikanti et
al. 2022; the formula and its cases are in :mod:`lightning_shard.memory.estimate`'s docstring).

Takes layers, width, heads, vocabulary and sequence length; gives counts of parameters and bytes for the estimate.

Example:
    >>> gpt_parameter_count(n_layer=2, n_embd=64, vocab_size=256, block_size=32)
    (118528, 49984)
"""

from lightning_shard.memory.units import checkpointing_mode


def gpt_parameter_count(n_layer: int, n_embd: int, vocab_size: int, block_size: int) -> tuple[int, int]:
    """``(total, largest unit)`` of a GPT-2-style model: ``12·L·h² + 13·L·h + (V + S)·h + 2h`` (tied output head).

    Example:
        >>> gpt_parameter_count(n_layer=40, n_embd=5140, vocab_size=50257, block_size=2048)[0]
        12952938780
    """
    block = 12 * n_embd**2 + 13 * n_embd
    root = (vocab_size + block_size) * n_embd + 2 * n_embd
    return n_layer * block + root, max(block, root)


def activation_bytes(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    seq_len: int,
    micro_batch_size: int,
    vocab_size: int | None,
    compute_bytes: int,
    activation_checkpointing: bool | str,
    fused_attention: bool = True,
    tensor_parallel_size: int = 1,
) -> int:
    """Activation bytes of one micro-batch (Korthikanti et al. 2022), see :mod:`lightning_shard.memory.estimate`.

    Example:
        >>> dims = dict(n_layer=1, n_embd=64, n_head=4, seq_len=32, micro_batch_size=1, vocab_size=None)
        >>> activation_bytes(**dims, compute_bytes=2, activation_checkpointing=False)  # 34 s·b·h
        69632
        >>> activation_bytes(**dims, compute_bytes=2, activation_checkpointing=False, fused_attention=False)
        90112
        >>> activation_bytes(**dims, compute_bytes=2, activation_checkpointing=False, tensor_parallel_size=2)
        45056
        >>> [activation_bytes(**dims, compute_bytes=2, activation_checkpointing=mode) for mode in ("full", "selective")]
        [73728, 106496]
    """
    sbh = seq_len * micro_batch_size * n_embd
    scale = compute_bytes / 2  # the formula counts 16-bit activations
    t = tensor_parallel_size
    scores = 0 if fused_attention else 5 * n_head * seq_len / (n_embd * t)
    layer = sbh * (10 + 24 / t + scores) * scale
    mode = checkpointing_mode(activation_checkpointing)
    kept = {"full": 2 * sbh, "selective": 2 * sbh * (1 + 8 / t)}  # per checkpointed layer (module docstring)
    layers = n_layer * kept[mode] * scale + layer if mode in kept else n_layer * layer
    logits = 4 * seq_len * micro_batch_size * vocab_size if vocab_size else 0
    return int(layers + logits)
