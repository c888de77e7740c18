"""FLUX.1 dev and schnell: diffusers folders and kohya's separate files (BFL transformer, clip_l, t5xxl, ae)."""
