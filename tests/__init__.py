"""The test suite, a package so that its support code is imported by name (``tests.support``)."""
