"""Architecture numbers of the models the shipped serve configs name, so the budget runs without a download.

Each entry holds the fields of the model's config.json that ModelShape.from_config reads (copied from the model's
published config.json). A config.json on disk or in the Hugging Face cache is preferred when there is one.
"""

from __future__ import annotations

from typing import Any

KNOWN_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # serve_configs/prod.yaml
    "Qwen/Qwen2.5-32B-Instruct": {
        "model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    },
}
