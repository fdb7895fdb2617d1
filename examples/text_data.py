"""Tokenized Genesis (KJV) as a LightningDataModule for the examples.

The tokenizer is trained here, from the shipped corpus, so the examples need no download.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader, Dataset

DEFAULT_CORPUS = str(Path(__file__).resolve().parent / "data" / "genesis_kjv.txt")
DEFAULT_TOKENIZER_DIR = Path("outputs") / "tokenizer"
END_OF_TEXT = "<|endoftext|>"
VAL_FRACTION = 0.05


class TokenWindows(Dataset):
    """Fixed-length token windows; labels equal inputs because the HF model shifts them itself."""

    def __init__(self, windows: torch.Tensor) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window}


class TextDataModule(L.LightningDataModule):
    """Byte-level BPE over a plain-text corpus, cut into `seq_len + 1` token windows.

    A window of `seq_len + 1` tokens gives exactly `seq_len` next-token targets after the
    model's internal shift. The last 5% of windows are the validation set: a contiguous tail,
    so no validation text also appears in a training window.
    """

    def __init__(
        self,
        corpus: str = DEFAULT_CORPUS,
        vocab_size: int = 2048,
        seq_len: int = 128,
        batch_size: int = 8,
        num_workers: int = 0,
        tokenizer_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.corpus = Path(corpus)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else DEFAULT_TOKENIZER_DIR
        self.tokenizer: Tokenizer | None = None
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None

    @property
    def tokenizer_path(self) -> Path:
        # Keyed by corpus content and vocabulary size, so an edited corpus never reuses a stale file.
        digest = hashlib.sha256(self.corpus.read_bytes()).hexdigest()[:12]
        return self.tokenizer_dir / f"bpe-{self.vocab_size}-{digest}.json"

    def prepare_data(self) -> None:
        path = self.tokenizer_path
        if path.exists():
            return
        tokenizer = train_tokenizer(self.corpus, self.vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so an interrupted run never leaves a truncated tokenizer behind.
        partial = path.with_suffix(".json.partial")
        tokenizer.save(str(partial))
        partial.replace(path)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if not self.tokenizer_path.exists():
            self.prepare_data()
        self.tokenizer = Tokenizer.from_file(str(self.tokenizer_path))
        if self.tokenizer.get_vocab_size() > self.vocab_size:
            raise ValueError(
                f"tokenizer {self.tokenizer_path} has {self.tokenizer.get_vocab_size()} tokens, "
                f"more than vocab_size={self.vocab_size}; delete it to retrain"
            )
        ids = torch.tensor(self.tokenizer.encode(self.corpus.read_text(encoding="utf-8")).ids, dtype=torch.long)
        window = self.seq_len + 1
        count = ids.numel() // window
        if count < 2:
            raise ValueError(f"{self.corpus} gives {count} windows of {window} tokens; need at least 2")
        windows = ids[: count * window].view(count, window)
        val_count = max(1, round(count * VAL_FRACTION))
        self.train_set = TokenWindows(windows[: count - val_count])
        self.val_set = TokenWindows(windows[count - val_count :])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)


def train_tokenizer(corpus: Path, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer; the same corpus and size always give the same merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        # Seeding all 256 byte symbols means any input text can be encoded, not only the corpus's.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)
    return tokenizer
