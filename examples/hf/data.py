"""Text for fine-tuning: the GPT example's data module, tokenised by a local Hugging Face tokenizer or into bytes.

Without ``tokenizer_path`` the text is split into its UTF-8 bytes (token ids 0..255), which fits a model with a
256-token vocabulary such as the tiny random Llama of ``configs/hf_llama_tiny.yaml``: no tokenizer to download.
For a real pretrained model, point ``tokenizer_path`` at its directory (``tokenizer.json`` etc., usually the same
directory as the weights); it is loaded locally with ``AutoTokenizer`` and never downloaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from examples.gpt.data import TokenDataModule


class TextDataModule(TokenDataModule):
    """:class:`~examples.gpt.data.TokenDataModule` (stdlib source text by default, random windows, resumable
    sampling) with text tokenised by the HF tokenizer in ``tokenizer_path``, or into bytes without one.

    Example:
        >>> dm = TextDataModule(block_size=32, batch_size=4, samples_per_epoch=64, max_bytes=10_000)
        >>> dm.setup("fit")
        >>> dm.vocab_size
        256
    """

    def __init__(self, tokenizer_path: str | None = None, **kwargs: Any) -> None:
        """
        Args:
            tokenizer_path: a local HF tokenizer directory; ``None``: byte-level (vocabulary 256).
            **kwargs: :class:`~examples.gpt.data.TokenDataModule`'s arguments (``data_path``, ``block_size``, ...).
        """
        super().__init__(**kwargs)
        self.save_hyperparameters()
        self.tokenizer = None
        if tokenizer_path is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary (with added tokens), 256 for bytes, unknown (``None``) for ``.bin`` files."""
        if self.tokenizer is not None and self._bin_dir() is None:
            return len(self.tokenizer)
        return super().vocab_size

    def tokenize(self, text: bytes) -> np.ndarray:
        if self.tokenizer is None:
            return super().tokenize(text)
        # verbose=False: the text is far longer than the model's context on purpose (it is cut into windows).
        ids = self.tokenizer(text.decode("utf-8", errors="replace"), add_special_tokens=False, verbose=False)
        return np.asarray(ids["input_ids"], dtype=np.int32)
