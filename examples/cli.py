"""LightningCLI for the example model and data: `python examples/cli.py fit --config configs/demo.yaml`."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

# Imported for its side effect: it registers the strategy name "ratel" (`--trainer.strategy ratel`).
import lightning_ratel  # noqa: F401
from lm_module import CausalLMModule
from text_data import TextDataModule


class LanguageModelCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        # The model's embedding and position sizes must match what the data module produces.
        parser.link_arguments("data.vocab_size", "model.vocab_size")
        parser.link_arguments("data.seq_len", "model.max_seq_len")


def main() -> None:
    LanguageModelCLI(CausalLMModule, TextDataModule)


if __name__ == "__main__":
    main()
