"""Causal-LM training as transformers' `examples/pytorch/language-modeling/run_clm.py` does it, with the README's HF
snippet applied: run by tests/adapters/test_trackers.py with `--report_to all`.

Written for these tests, not a copy of run_clm.py: the same shape (`HfArgumentParser` over the script's
arguments and `TrainingArguments`, a text file loaded with `datasets`, tokenized, concatenated and cut into
`block_size` blocks, a model built from `--config_overrides` of a config, `Trainer(...).train()`), with no download:
the tokenizer is a byte-level BPE trained on the text file itself. `--trainer sft` trains with TRL's
`SFTTrainer` instead. Usage::

    ZEUS_CALLBACKS_SIMULATE=a40 python train_clm.py --train_file t.txt --output_dir out --report_to all
        --max_steps 12 --logging_steps 4 --use_cpu true --trainer zeus   # (one line)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from datasets import load_dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from zeus_callbacks import HFGlobalPowerLimitOptimizer, HFZeusMonitor, MaxSlowdownConstraint, ZeusMonitor
from zeus_callbacks.huggingface import ZeusTrainerMixin

EOS = "<|endoftext|>"


@dataclass
class ScriptArguments:
    train_file: str = field(metadata={"help": "A text file, one example a line."})
    config_overrides: str = field(
        default="n_layer=2,n_head=2,n_embd=32,n_positions=64", metadata={"help": "GPT-2 config overrides."}
    )
    block_size: int = field(default=32)
    trainer: str = field(
        default="zeus",
        metadata={
            "help": "plain: `Trainer(callbacks=[...])`; zeus: `class MyTrainer(ZeusTrainerMixin, Trainer)` "
            "(the README's way to the trackers); sft: the same with TRL's `SFTTrainer`.",
            "choices": ["plain", "zeus", "sft"],
        },
    )


class MyTrainer(ZeusTrainerMixin, Trainer):
    """The README's HF snippet: the callbacks' metrics reach the `report_to` trackers."""


def byte_level_tokenizer(lines: list[str]) -> PreTrainedTokenizerFast:
    """A GPT-2-like byte-level BPE trained on `lines` (run_clm loads one with `--tokenizer_name`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        lines, trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS], initial_alphabet=alphabet)
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=1024)


def lm_blocks(raw, tokenizer: PreTrainedTokenizerFast, block_size: int):
    """run_clm's preprocessing: tokenize, concatenate, cut into `block_size` blocks whose labels are the inputs."""

    def group_texts(examples: dict) -> dict:
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // block_size * block_size
        out = {k: [t[i : i + block_size] for i in range(0, total, block_size)] for k, t in joined.items()}
        out["labels"] = out["input_ids"].copy()
        return out

    tokenized = raw.map(lambda b: tokenizer(b["text"]), batched=True, remove_columns=["text"])
    return tokenized.map(group_texts, batched=True)


def trainer_and_arguments(kind: str) -> tuple[type[Trainer], type[TrainingArguments]]:
    """The trainer class `--trainer` names, and the arguments class it takes."""
    if kind == "sft":
        from trl import SFTConfig, SFTTrainer

        class MySFTTrainer(ZeusTrainerMixin, SFTTrainer):
            """The README's HF snippet with TRL's `SFTTrainer`."""

        return MySFTTrainer, SFTConfig
    return (MyTrainer if kind == "zeus" else Trainer), TrainingArguments


def main() -> None:
    parsed = HfArgumentParser(ScriptArguments).parse_args_into_dataclasses(return_remaining_strings=True)
    script_args, rest = parsed
    trainer_cls, args_cls = trainer_and_arguments(script_args.trainer)
    (training_args,) = HfArgumentParser(args_cls).parse_args_into_dataclasses(rest)
    raw = load_dataset("text", data_files={"train": script_args.train_file})["train"]
    tokenizer = byte_level_tokenizer(raw["text"])
    config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=0, eos_token_id=0)
    config.update_from_string(script_args.config_overrides)
    model = AutoModelForCausalLM.from_config(config)

    # The README's HF snippet.
    monitor = ZeusMonitor(gpu_indices=[training_args.local_process_index])  # this process's GPU
    plo = HFGlobalPowerLimitOptimizer(monitor, MaxSlowdownConstraint(factor=1.1))
    callbacks = [plo, HFZeusMonitor(monitor)]

    if script_args.trainer == "sft":  # TRL tokenizes the text itself
        data = {"train_dataset": raw}
    else:
        data = {
            "train_dataset": lm_blocks(raw, tokenizer, script_args.block_size),
            "data_collator": default_data_collator,
        }
    trainer = trainer_cls(
        model=model, args=training_args, processing_class=tokenizer, callbacks=callbacks, **data
    )
    trainer.train()
    trainer.save_state()  # as run_clm.py does: trainer_state.json, with the log history


if __name__ == "__main__":
    main()
