"""Qwen-Image: diffusers folders and the separate files musubi-tuner trains from."""
