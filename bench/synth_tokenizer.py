"""A word-level tokenizer for a dummy-weight model, so ``vllm serve`` (without
``--skip-tokenizer-init``) and ``vllm bench serve`` run with ``load_format=dummy`` and nothing
but the model's ``config.json``: token i is the word ``t<i>``, words are joined by spaces, and
decoding then encoding returns the same ids (which vLLM's benchmark client relies on).

    python -m bench.synth_tokenizer MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def write(model_dir: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` next to ``config.json``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    size = int(config["vocab_size"])
    eos = config.get("eos_token_id", size - 1)
    eos = int(eos[0] if isinstance(eos, list) else eos)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token=f"t{eos}"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins with spaces
    tokenizer.save(str(model_dir / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": f"t{eos}",
        "model_max_length": int(config.get("max_position_embeddings", 32768)),
        "clean_up_tokenization_spaces": False,
    }
    if config.get("bos_token_id") is not None:
        settings["bos_token"] = f"t{int(config['bos_token_id'])}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=1))
    return model_dir


if __name__ == "__main__":
    for directory in sys.argv[1:]:
        print(f"{write(directory)}: synthetic tokenizer")
