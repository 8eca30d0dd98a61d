"""eyas: train EAGLE-3 draft models and prove they make the target faster."""
__version__ = "0.1.0"
