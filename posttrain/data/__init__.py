"""Data layer: records, format detection, readers/writers with quarantine, tokenisation, packing."""
