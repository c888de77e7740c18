"""SD3 and SD3.5 (Medium, Large): diffusers folders and Stability's single files, with kohya's separate encoders."""
