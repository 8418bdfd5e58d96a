"""Readers and writers of Caffe's files."""
