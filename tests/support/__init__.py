"""Test doubles of interfaces (named as such) and reference implementations the tests
compare against; not tests."""
