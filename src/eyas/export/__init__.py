"""Export a trained drafter in its family's format, check any drafter directory, decide whether one fits a target."""
