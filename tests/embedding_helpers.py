"""Tiny random-weight embedding checkpoints in sentence-transformers' own format (its `save()` writes
modules.json, the Pooling module's config and 2_Normalize beside the transformers files), and the
reference vectors sentence-transformers computes for them."""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch

from model_helpers import save_tiny_checkpoint, tiny_tokenizer

BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(5, 1000)]


def _save_bert(directory: str, seed: int, **overrides: Any) -> None:
    import transformers
    torch.manual_seed(seed)
    dims = dict(vocab_size=len(BERT_VOCAB), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=256)
    dims.update(overrides)
    model = transformers.BertModel(transformers.BertConfig(**dims)).eval()
    with torch.no_grad():       # random init leaves LayerNorms at 1/0 and biases at 0: perturb them
        for name, param in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "vocab.txt"), "w") as fh:
        fh.write("\n".join(BERT_VOCAB) + "\n")
    transformers.BertTokenizerFast(os.path.join(directory, "vocab.txt"), do_lower_case=False).save_pretrained(directory)


def _drop_chat_template(directory: str) -> None:
    import json
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(path):
        os.remove(path)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as fh:
        config = json.load(fh)
    config.pop("chat_template", None)
    with open(config_path, "w") as fh:
        json.dump(config, fh)


def save_embedding_checkpoint(kind: str, directory: str, pooling: str, normalize: bool = True, seed: int = 0,
                              **overrides: Any) -> str:
    """kind "bert" (a BertModel encoder) or "qwen3" / "llama" (a decoder); pooling "cls" | "mean" |
    "lasttoken". Returns `directory`, a sentence-transformers model directory tokenmill loads as it is."""
    from sentence_transformers import SentenceTransformer, models
    raw = directory + "-hf"
    if kind == "bert":
        _save_bert(raw, seed, **overrides)
    else:
        save_tiny_checkpoint(kind, raw, seed=seed, **overrides)
        tok = tiny_tokenizer()
        tok.pad_token = "<unk>"      # sentence-transformers pads a batch
        tok.save_pretrained(raw)
        _drop_chat_template(raw)     # with one, sentence-transformers 6 wraps each text as a chat message
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = models.Transformer(raw)
        dim = transformer.get_word_embedding_dimension()
        modules = [transformer, models.Pooling(dim, pooling_mode=pooling)]
        if normalize:
            modules.append(models.Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(directory)
    return directory


def reference_vectors(directory: str, texts: list[str], truncate_dim: Optional[int] = None) -> torch.Tensor:
    """sentence-transformers' vectors (float32, normalized when the model has a Normalize module,
    and after truncation when truncate_dim is given)."""
    from sentence_transformers import SentenceTransformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(directory, device="cpu", truncate_dim=truncate_dim)
        return st.encode(texts, convert_to_tensor=True, batch_size=len(texts),
                         normalize_embeddings=truncate_dim is not None).float()


def cosines(got: list[list[float]], want: torch.Tensor) -> list[float]:
    return [torch.nn.functional.cosine_similarity(torch.tensor(g), w, dim=0).item() for g, w in zip(got, want)]
