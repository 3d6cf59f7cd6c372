"""radixlang."""
