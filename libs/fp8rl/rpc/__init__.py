"""Generated gRPC stubs live here (generated from proto/ by `make proto`)."""
