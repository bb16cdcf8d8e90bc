#include <omp.h>
#include <stdio.h>
#include <chrono>
int main() {
    volatile int x = 0;
    for (int rep = 0; rep < 3; ++rep) {
        auto t = std::chrono::steady_clock::now();
        int N = 100000;
        for (int i = 0; i < N; ++i) {
#pragma omp parallel num_threads(2)
            { x += 1; }
        }
        auto e = std::chrono::steady_clock::now();
        double us = std::chrono::duration<double, std::micro>(e - t).count() / N;
        auto t2 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(2)
        for (int i = 0; i < N; ++i) {
#pragma omp barrier
        }
        auto e2 = std::chrono::steady_clock::now();
        double us2 = std::chrono::duration<double, std::micro>(e2 - t2).count() / N;
        printf("parallel region %.2f us, barrier %.2f us\n", us, us2);
    }
}
