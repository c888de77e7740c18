"""Wan 2.1 / 2.2 text-to-video: diffusers folders and the separate files musubi-tuner trains from."""
