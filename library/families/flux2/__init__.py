"""FLUX.2 [klein]: diffusers folders, trained as musubi-tuner's flux_2_train_network.py trains them."""
