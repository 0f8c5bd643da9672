"""Functional model definitions: params pytree in, arrays out, state explicit.

``decoder`` holds the stack all supported families share (qwen3, qwen3_5, qwen3_5_moe, qwen3_next);
``params`` maps Hugging Face tensor names onto its params pytree.
"""
