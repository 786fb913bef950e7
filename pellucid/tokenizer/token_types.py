"""A GGUF vocabulary's token types (`tokenizer.ggml.token_type`, llama.cpp's llama_token_type):
control and unknown tokens are matched in text only with parse_special, user-defined ones always,
byte tokens stand for one byte each."""

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
