"""Model files in and out: GGUF and Hugging Face folders, weights, tokenizers, synthetic models."""
