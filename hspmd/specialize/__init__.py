"""hspmd.specialize"""
