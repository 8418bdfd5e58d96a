"""Datasets (Caffe LMDB, ImageData lists, image folders, arrays) and Caffe's transforms."""
