"""Image input on the host: decoding and preprocessing (``preprocess``), the prompt's image
placeholders, multimodal rotary positions and content-keyed cache ids (``prompt``). Plain numpy
and Pillow; nothing here imports JAX or the engine."""
