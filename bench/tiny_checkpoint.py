"""Write a small Llama checkpoint with random weights that *matter* (std 0.05 projections),
so greedy outputs depend on every layer (vLLM's dummy weights are ~1e-3 and leave the
residual stream nearly untouched). Offline, no tokenizer: prompts are token ids.

    python -m bench.tiny_checkpoint OUT_DIR [--layers 8 --hidden 256 ...]
    python -m bench.tiny_checkpoint OUT_DIR --architecture Gemma3ForCausalLM

``--architecture`` writes another decoder family the same way, through its Hugging Face
model class (:data:`ARCHITECTURES`: attention biases, fused projections, sliding-window
layers beside full ones), for the architecture tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def make_checkpoint(
    out: str | Path,
    layers: int = 8,
    hidden: int = 256,
    intermediate: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 1024,
    seed: int = 0,
) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rand(vocab, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
    save_file(tensors, str(out / "model.safetensors"))
    return out


# Small configurations of decoder families other than Llama, each with what sets it apart
# for the plugin: Qwen2's attention biases, Phi-3's fused QKV and gate-up projections,
# Gemma 3's sliding-window layers beside full ones, with its own norms and scaled
# embeddings. Embeddings are untied: tied to
# random embeddings of std 1, the head's logit for the last token's own embedding dwarfs
# the rest and every model repeats its prompt's last token whatever its layers hold (seen
# on Qwen2: a layer swapped for its partner left every output the same).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "Qwen2ForCausalLM": {"model_type": "qwen2", "tie_word_embeddings": False},
    "Phi3ForCausalLM": {"model_type": "phi3", "tie_word_embeddings": False},
    "Gemma3ForCausalLM": {
        "model_type": "gemma3_text",
        "tie_word_embeddings": False,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"] * 4,
        "query_pre_attn_scalar": 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_local_base_freq": 10000.0,
        # wider: a layer must free more than one KV group (a page in each KV tensor)
        "hidden_size": 512,
        "intermediate_size": 2048,
    },
}


def make_hf_checkpoint(out: str | Path, architecture: str, seed: int = 0) -> Path:
    """``architecture`` (a key of :data:`ARCHITECTURES`), 8 layers, random weights that
    matter: every matrix std 0.05, embeddings std 1, norms as the family initializes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    spec = dict(ARCHITECTURES[architecture])
    model_type = spec.pop("model_type")
    dims = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 8,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    config = AutoConfig.for_model(model_type, **(dims | spec))
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 1.0 if "embed" in name else 0.05)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES), default=None)
    args = parser.parse_args()
    if args.architecture:
        print(make_hf_checkpoint(args.out, args.architecture))
    else:
        print(make_checkpoint(args.out, args.layers, args.hidden, args.intermediate))


if __name__ == "__main__":
    main()
