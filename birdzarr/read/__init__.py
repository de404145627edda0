"""Reading: chunk fetching and decoding, epoch planning, and the PyTorch dataset."""
