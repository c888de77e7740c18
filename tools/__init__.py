"""Scripts that regenerate the committed datasets and the digits base model."""
