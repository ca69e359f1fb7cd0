"""fp8rl service package (see DESIGN §1); servers land with the services issue."""
