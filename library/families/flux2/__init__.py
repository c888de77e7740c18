"""FLUX.2 [klein]: diffusers folders and the separate files musubi-tuner trains from."""
