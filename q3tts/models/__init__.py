"""Model definitions: plain `nn.Module`s whose parameter names are the checkpoints' tensor names."""
