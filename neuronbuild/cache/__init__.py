"""Cache phase: content-addressed blobs (CAS) plus action records, written atomically under file locks."""
