"""A byte-level tokenizer written at test time in Llama-3's shape: its special tokens, a BOS added by the
post-processor, and Llama-3-Instruct's chat template (BOS rendered by the template itself)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
BOS_ID, EOT_ID = 0, 2  # a target written with bos_token_id 0 and eos_token_id [1, 2] stops at <|eot_id|>
# Meta-Llama-3-8B-Instruct's tokenizer_config.json chat_template, as published
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # specials, then one token per byte


def write_llama3_tokenizer(out_dir: Path, chat_template: str | None = LLAMA3_CHAT_TEMPLATE) -> Path:
    """tokenizer.json + tokenizer_config.json in ``out_dir`` (a checkpoint directory whose vocab >= VOCAB_SIZE)."""
    byte_tokens = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + sorted(byte_tokens))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", BOS_ID)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=chat_template
    )
    tokenizer.save_pretrained(out_dir)
    return out_dir
