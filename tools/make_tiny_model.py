"""Write a small random Hugging Face model (config, safetensors, character-level tokenizer) from a
``model_configs/`` entry, without any download.

    python tools/make_tiny_model.py tiny-qwen2 /tmp/tiny-qwen2 [--seed 0] [--std 0.08] [a.b=value ...]

Used by the tests (conversion, rollouts, weight sync) and by the CPU demo. The tokenizer maps every
printable ASCII character and newline to one token, so any text round-trips; ids 0 and 1 are
``<|endoftext|>`` (bos, eos and pad) and ``<unk>``, and filler tokens ``<|extra_i|>`` pad it to
exactly the model's ``vocab_size`` (an engine never meets an id without a token).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_empg.config import ModelConfig, load_model_config  # noqa: E402

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<unk>"
CHARACTERS = [chr(c) for c in range(32, 127)] + ["\n"]
NUM_BASE_TOKENS = 2 + len(CHARACTERS)  # eos, unk, characters


def _byte_level(character: str) -> str:
    """GPT-2's byte-level symbol of an ASCII character: itself if printable, else a letter from
    U+0100 on (space: "Ġ", newline: "Ċ")."""
    code = ord(character)
    return chr(code + 256) if code <= 32 else character


def char_tokenizer(vocab_size: int):
    """A ``transformers.PreTrainedTokenizerFast``: one token per character, ``vocab_size`` ids in all.

    Byte-level BPE without merges, as GPT-2 / Qwen tokenizers are built: for a Qwen2-family
    model directory, transformers 5 loads any tokenizer as ``Qwen2Tokenizer``, which rebuilds the
    pipeline from the vocabulary (byte-level pre-tokenization, BPE) and so drops every vocabulary
    entry that is not a byte-level symbol (a plain " " or "\n": spaces and newlines vanished).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < NUM_BASE_TOKENS:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the {NUM_BASE_TOKENS} tokens of the character set")
    vocab = {EOS_TOKEN: 0, UNK_TOKEN: 1}
    for character in CHARACTERS:
        vocab[_byte_level(character)] = len(vocab)
    for i in range(vocab_size - len(vocab)):
        vocab[f"<|extra_{i}|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges=[], unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [EOS_TOKEN, UNK_TOKEN] + [t for t in vocab if t.startswith("<|extra_")]
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=1 << 20,
    )


def tiny_hf_model(model: ModelConfig, *, seed: int = 0, std: float = 0.08):
    """A random ``transformers`` causal LM of ``model``'s architecture in float32.

    Every tensor is redrawn (norm weights around 1, biases too) so that each one changes the output:
    a conversion that drops or swaps any tensor shows in the logits.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_kwargs = model.to_hf_config()
    hf_kwargs.update(dtype="float32", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = AutoConfig.for_model(**hf_kwargs)
    generator = torch.Generator().manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            noise = torch.randn(tensor.shape, generator=generator) * std
            tensor.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    return hf.eval()


def save_tiny_hf_model(
    model: ModelConfig, out_dir: str | Path, *, seed: int = 0, std: float = 0.08, tokenizer: bool = True
) -> Path:
    """Write ``tiny_hf_model(model)`` (and ``char_tokenizer``) to ``out_dir`` with ``save_pretrained``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tiny_hf_model(model, seed=seed, std=std).save_pretrained(out)
    if tokenizer:
        char_tokenizer(model.vocab_size).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a name in model_configs/ (e.g. tiny-qwen2) or a YAML path")
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--std", type=float, default=0.08, help="standard deviation of the random weights")
    parser.add_argument("overrides", nargs="*", help="dotted overrides of the model config, e.g. vocab_size=512")
    args = parser.parse_args(argv)
    model = load_model_config(args.model, args.overrides)
    out = save_tiny_hf_model(model, args.out_dir, seed=args.seed, std=args.std)
    print(f"wrote {model.name} ({model.family}, {model.num_parameters():,} parameters) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
