"""Z-Image (base and Turbo): diffusers folders and the separate files musubi-tuner trains from."""
