"""Evaluation of converted models: ``pi-perplexity`` (llama.cpp's perplexity method)."""
