"""Qwen-style tokenizer conventions shared by every tokenizer the project builds (the tiny
checkpoints' in the torch env, the ground-truth models' in the engine env). Plain constants: this
module imports nothing, so both environments can use it."""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2/Qwen3's pre-tokenisation regex (from their tokenizer.json): digits split one by one.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML template (the shape of Qwen2.5's, without tools): a default system prompt
# when the conversation has none.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
